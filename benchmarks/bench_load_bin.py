"""Loading a PyTorch `.bin` checkpoint under FSDP2 on 2 ranks: each rank's peak RSS rise, read shard by shard vs
whole load then shard.

A Qwen3-shaped bf16 model built by transformers (`Qwen3ForCausalLM`, ~0.16B parameters, ~310 MiB, untied head),
its weights written as transformers' `save_pretrained(safe_serialization=False)` wrote them (transformers 5 writes
safetensors only): `pytorch_model-0000i-of-0000n.bin` shards of about 100 MB (torch.save's zip format) and
`pytorch_model.bin.index.json`; cached (KILN_BENCH_CACHE, default ~/.cache/kiln-bench/load). Two gloo ranks,
`fsdp = true`, each side in fresh processes (torch.distributed.run):

- kiln (sharded): the model built on meta, FSDP2 applied there, `read_shards`: each rank learns where each tensor
  lies from the pickle read onto meta (`weights_only=True`, no tensor data) and reads its rows from the files;
- whole: `load_pretrained` on every rank (torch.load of every shard, `weights_only=True`), then FSDP2;
- mmap (the design not taken, measured for the choice): built on meta and FSDP2 applied as kiln does, then each
  rank copies its rows out of `torch.load(mmap=True, weights_only=True)` mappings of the shards (no logits: its
  non-persistent buffers are left unset).

Each rank reports its VmHWM minus its VmRSS just before the load (the load's rise), the bytes it holds after it,
and one forward's logits (both sides must give the same). Ratios last: the sharded rise over the whole load's.

    python benchmarks/bench_load_bin.py [--layers 8]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launched_ranks, load_args, load_average, rank_load, rank_report, report

MiB = 1024 ** 2
SHARD_BYTES = 100 * 1000 ** 2  # several files + the index, as a release shipped them


def shape(layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)


def build(size: dict) -> Path:
    """The cached .bin checkpoint of a bf16 Qwen3 built by transformers."""
    import torch
    import transformers

    from kiln.hub.weights import save_bin_weights

    tag = hashlib.sha256(json.dumps([size, SHARD_BYTES], sort_keys=True).encode()).hexdigest()[:10]
    root = Path(os.environ.get("KILN_BENCH_CACHE", Path.home() / ".cache" / "kiln-bench" / "load"))
    out = root / f"qwen3-bin-{tag}"
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**size)).to(torch.bfloat16)
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(tmp)
        save_bin_weights(tmp, model.state_dict(), SHARD_BYTES)
        tmp.rename(out)
    return out


def mmap_load(model_dir: str, plan) -> tuple[int, int, float]:
    """Each rank's rows copied out of mapped shards: (the load's peak RSS rise, the bytes it holds, its seconds)."""
    import torch
    import torch.distributed as dist
    from common import rss_kb
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from kiln.hub.weights import weight_files
    from kiln.parallel.apply import parallelize
    from kiln.parallel.sharded_load import empty_pretrained, loaded_bytes

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_kb("VmRSS:")
    t0 = time.perf_counter()
    model = empty_pretrained(model_dir, task="causal-lm")
    parallelize(model, plan, device=torch.device("cpu"))
    maps = {}
    for f in weight_files(model_dir):
        maps.update(torch.load(f, mmap=True, weights_only=True, map_location="cpu"))
    keymap = model.family.keymap(model.task)
    sources = {keymap.kiln_name(k): t for k, t in maps.items()}
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            p.to_local().copy_(sources[name][offset[0]:offset[0] + shape[0]])
    del maps, sources
    return (rss_kb("VmHWM:") - before) * 1024, loaded_bytes(model), time.perf_counter() - t0


def child(side: str, model_dir: str, out: str) -> None:
    """One rank: load `model_dir` as `side` says under FSDP2, then report to `out`-rank<r>.json."""
    import torch
    import torch.distributed as dist

    from kiln.train.config import ParallelSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if side == "mmap":
        rise, held, seconds = mmap_load(model_dir, ParallelSection(fsdp=True))
        with open(f"{out}-rank{dist.get_rank()}.json", "w") as f:
            json.dump({"rise": rise, "held": held, "seconds": seconds}, f)
        return dist.destroy_process_group()
    model, rise, seconds = rank_load(side, model_dir, ParallelSection(fsdp=True))
    rank_report(model, out, rise, seconds)


def main() -> None:
    args = load_args()
    if args.child:
        return child(args.child, args.model, args.out)
    model = build(shape(args.layers))
    size = sum(f.stat().st_size for f in model.glob("*.bin"))
    print(f"checkpoint: {model} {size / MiB:.0f} MiB in {len(list(model.glob('*.bin')))} .bin files; {load_average()}")
    res = {}
    with tempfile.TemporaryDirectory() as work:
        for side in ("whole", "kiln", "mmap"):
            res[side] = launched_ranks(__file__, Path(work) / side, "--child", side, "--model", str(model))
            for r, got in enumerate(res[side]):
                print(f"{side} rank {r}: rise {got['rise'] / MiB:.0f} MiB ({got['rise'] / size:.2f}x the checkpoint), "
                      f"holds {got['held'] / MiB:.0f} MiB, {got['seconds']:.1f} s; {load_average()}", flush=True)
    same = all(a["logits_sum"] == b["logits_sum"] and a["logits_abs"] == b["logits_abs"]
               for a, b in zip(res["kiln"], res["whole"]))
    print(f"logits equal between the two loads: {same}")
    worst = {side: max(r["rise"] for r in res[side]) for side in res}
    print(f"mmap (the design not taken): rise {worst['mmap'] / MiB:.0f} MiB, {worst['mmap'] / worst['kiln']:.2f}x "
          f"kiln's read into place")
    report("PyTorch .bin checkpoint (sharded, index), FSDP2 on 2 ranks: a rank's load peak RSS rise (read shard by "
           "shard vs whole load then shard)", "whole load", "loads/min", [60 / max(r["seconds"] for r in res["kiln"])],
           [60 / max(r["seconds"] for r in res["whole"])], kiln_mem=worst["kiln"] / MiB, peer_mem=worst["whole"] / MiB,
           goal="reported", note=f"checkpoint {size / MiB:.0f} MiB; sharded rise {worst['kiln'] / size:.2f}x "
                                 f"checkpoint, whole {worst['whole'] / size:.2f}x; logits equal {same}")


if __name__ == "__main__":
    main()
