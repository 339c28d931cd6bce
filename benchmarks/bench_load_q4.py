"""Loading a 4-bit base under FSDP2 on 2 ranks: each rank's peak RSS rise, read shard by shard vs whole load then shard.

A Qwen3-shaped bf16 checkpoint written by transformers (`Qwen3ForCausalLM.save_pretrained`, several safetensors
files and the index; ~0.16B parameters, ~310 MiB, untied head), and the bitsandbytes-4bit directory kiln writes
from it (NF4, double-quantized absmax, byte for byte what bitsandbytes writes); both cached (KILN_BENCH_CACHE,
default ~/.cache/kiln-bench/load). Two gloo ranks, `fsdp = true`, each side in fresh processes
(torch.distributed.run), for two loads:

- quantize at load (`[model] quantize = "nf4"` on the bf16 checkpoint): kiln (sharded) builds the 4-bit model on
  meta, applies FSDP2 there and `read_shards`: each rank reads the bf16 values of its blocks and quantizes them
  (kiln.models.loading.q4); whole: `load_pretrained(quantize="nf4")` on every rank (the bf16 model, then
  quantized), then FSDP2;
- the bitsandbytes-4bit directory: kiln (sharded) reads each rank's packed bytes; whole: `load_pretrained`, then FSDP2.

Each rank reports its VmHWM minus its VmRSS just before the load (the load's rise), the bytes it holds after it,
and one forward's logits (both sides must give the same). Ratios last: the sharded rise over the whole load's.

    python benchmarks/bench_load_q4.py [--layers 8]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launched_ranks, load_args, load_average, rank_load, rank_report, report

MiB = 1024 ** 2
SHARD_SIZE = "100MB"  # several files + the index, as a release ships them


def shape(layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)


def build(size: dict) -> tuple[Path, Path]:
    """The cached bf16 checkpoint (written by transformers) and the NF4 directory kiln writes from it."""
    import torch
    import transformers

    from kiln.models.auto import load_pretrained
    from kiln.models.common.quant4 import quantize_model

    tag = hashlib.sha256(json.dumps([size, SHARD_SIZE], sort_keys=True).encode()).hexdigest()[:10]
    root = Path(os.environ.get("KILN_BENCH_CACHE", Path.home() / ".cache" / "kiln-bench" / "load"))
    bf16, nf4 = root / f"qwen3-q4src-{tag}", root / f"qwen3-nf4-{tag}"
    if not (bf16 / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**size)).to(torch.bfloat16)
        tmp = bf16.with_name(bf16.name + ".partial")
        model.save_pretrained(tmp, max_shard_size=SHARD_SIZE)
        tmp.rename(bf16)
    if not (nf4 / "config.json").exists():
        model = load_pretrained(bf16, task="causal-lm")
        quantize_model(model, "nf4")
        tmp = nf4.with_name(nf4.name + ".partial")
        model.save_pretrained(tmp, max_shard_bytes=50 * MiB)
        tmp.rename(nf4)
    return bf16, nf4


def child(side: str, model_dir: str, quantize: str | None, out: str) -> None:
    """One rank: load `model_dir` as `side` says under FSDP2, then report to `out`-rank<r>.json."""
    import torch
    import torch.distributed as dist

    from kiln.train.config import ParallelSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, rise, seconds = rank_load(side, model_dir, ParallelSection(fsdp=True), quantize=quantize)
    rank_report(model, out, rise, seconds)


def run_side(side: str, model: Path, quantize: str | None, work: Path) -> list[dict]:
    return launched_ranks(__file__, work / f"{side}-{quantize}", "--child", side, "--model", str(model),
                          "--quantize", quantize or "")


def main() -> None:
    args = load_args(quantize=None)
    if args.child:
        return child(args.child, args.model, args.quantize or None, args.out)
    bf16, nf4 = build(shape(args.layers))
    sizes = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (bf16, nf4)}
    print(f"checkpoints: bf16 {bf16} {sizes[bf16] / MiB:.0f} MiB; NF4 {nf4} {sizes[nf4] / MiB:.0f} MiB; {load_average()}")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for what, model, quantize in (("quantize at load (bf16 checkpoint, nf4)", bf16, "nf4"),
                                      ("bitsandbytes-4bit directory (NF4)", nf4, None)):
            res = {}
            for side in ("whole", "kiln"):
                res[side] = run_side(side, model, quantize, Path(work))
                for r, got in enumerate(res[side]):
                    print(f"{what}, {side} rank {r}: rise {got['rise'] / MiB:.0f} MiB ({got['rise'] / sizes[model]:.2f}x "
                          f"the checkpoint), holds {got['held'] / MiB:.0f} MiB, {got['seconds']:.1f} s; {load_average()}",
                          flush=True)
            same = all(a["logits_sum"] == b["logits_sum"] and a["logits_abs"] == b["logits_abs"]
                       for a, b in zip(res["kiln"], res["whole"]))
            print(f"{what}: logits equal between the two loads: {same}")
            worst = {side: max(r["rise"] for r in res[side]) for side in res}
            rows.append((what, res, worst, same, sizes[model]))
    for what, res, worst, same, ckpt in rows:
        report(f"4-bit base, FSDP2 on 2 ranks, {what}: a rank's load peak RSS rise (read shard by shard vs whole "
               "load then shard)", "whole load", "loads/min", [60 / max(r["seconds"] for r in res["kiln"])],
               [60 / max(r["seconds"] for r in res["whole"])], kiln_mem=worst["kiln"] / MiB,
               peer_mem=worst["whole"] / MiB, goal="reported",
               note=f"checkpoint {ckpt / MiB:.0f} MiB; sharded rise {worst['kiln'] / ckpt:.2f}x checkpoint, whole "
                    f"{worst['whole'] / ckpt:.2f}x; logits equal {same}")


if __name__ == "__main__":
    main()
