"""Reading an FP8 MoE release kept FP8 (`fp8 = "keep"`) under expert parallelism: each rank's peak RSS.

A Qwen3-MoE-shaped checkpoint in the DeepSeek-V3 layout (every projection and per-expert weight float8_e4m3fn
with 128 x 128 float32 `weight_scale_inv` blocks, embeddings, head and norms bf16; several safetensors files and
the index), written once by kiln and cached (KILN_BENCH_CACHE, default ~/.cache/kiln-bench/load). The routed
experts hold most of its bytes. Two gloo ranks, ep = 2, each side in fresh processes (torch.distributed.run):

- kiln (sharded): `empty_pretrained` on meta, the ep plan applied there, `read_shards`: each rank reads its
  half of the experts' FP8 bytes and scale grids, and the rest whole;
- peer (whole then shard): `load_pretrained(fp8="keep")` on every rank, then the same plan.

Each rank reports its VmHWM minus its VmRSS just before the load (the load's rise), the bytes it holds after
it, and one forward's logits (both sides must give the same). Ratios last: the sharded rise over the whole
load's, and each over the checkpoint's bytes; "expected" is the non-expert bytes plus half the experts'.

    python benchmarks/bench_load_fp8_ep.py [--layers 8] [--experts 32]
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
BLOCK = (128, 128)
SHARD_BYTES = 200 * MiB


def shape(layers: int, experts: int) -> dict:
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                num_experts=experts, num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
                max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)


def _quantized(name: str, t) -> bool:
    """What an FP8 release stores in FP8: the projections and the per-expert weights (not the router)."""
    return t.dim() == 2 and name.endswith("_proj.weight")


def build(size: dict) -> Path:
    """The cached FP8 checkpoint of `size`: kiln writes the bf16 model in shards, then each projection is
    quantized (kiln.hub.fp8.quantize) file by file."""
    import torch
    from safetensors.torch import load_file, save_file

    from kiln.hub.fp8 import quantize
    from kiln.models.auto import AutoConfig, from_config

    tag = hashlib.sha256(json.dumps([size, BLOCK, SHARD_BYTES], sort_keys=True).encode()).hexdigest()[:10]
    root = Path(os.environ.get("KILN_BENCH_CACHE", Path.home() / ".cache" / "kiln-bench" / "load"))
    out = root / f"moe-fp8-{tag}"
    if (out / "model.safetensors.index.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory(dir=root if root.exists() else None) as bf16:
        model = from_config(AutoConfig.for_model("qwen3_moe", **size), task="causal-lm", seed=0).to(torch.bfloat16)
        model.save_pretrained(bf16, max_shard_bytes=SHARD_BYTES)
        del model
        tmp.mkdir(parents=True, exist_ok=True)
        weight_map, total = {}, 0
        for name in sorted(f.name for f in Path(bf16).glob("*.safetensors")):  # one file or several: an index
            state = {}
            for k, v in load_file(str(Path(bf16) / name)).items():
                if _quantized(k, v):
                    state[k], state[k + "_scale_inv"] = quantize(v, BLOCK)
                else:
                    state[k] = v
            save_file(state, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(state, name))
            total += sum(t.nbytes for t in state.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                       "weight_map": weight_map}, indent=2))
        cfg = json.loads((Path(bf16) / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head"]}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


def child(side: str, model_dir: str, out: str) -> None:
    """One rank: load `model_dir` as `side` says under ep = 2, then report to `out`-rank<r>.json."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kiln.train.config import ParallelSection

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, rise, seconds = rank_load(side, model_dir, ParallelSection(ep=2), fp8="keep")
    local = {k: (t.to_local() if isinstance(t, DTensor) else t) for k, t in model.state_dict().items()}
    rank_report(model, out, rise, seconds, expert_held=sum(t.nbytes for k, t in local.items() if ".experts." in k),
                dtypes=sorted({str(t.dtype) for k, t in local.items() if ".experts." in k}))


def run_side(side: str, model: Path, work: Path) -> list[dict]:
    return launched_ranks(__file__, work / side, "--child", side, "--model", str(model))


def main() -> None:
    args = load_args(experts=32)
    if args.child:
        return child(args.child, args.model, args.out)
    model = build(shape(args.layers, args.experts))
    from safetensors import safe_open

    ckpt = experts = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - a safe_open handle has keys(), no __iter__
                n = h.get_slice(k)
                size = 1
                for d in n.get_shape():
                    size *= d
                nbytes = size * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[n.get_dtype()]
                ckpt += nbytes
                experts += nbytes if ".experts." in k else 0
    expected = ckpt - experts / 2
    print(f"checkpoint {model}: {ckpt / MiB:.0f} MiB, routed experts {experts / MiB:.0f} MiB "
          f"({experts / ckpt:.0%}); one rank's share (non-expert + half the experts) {expected / MiB:.0f} MiB; {load_average()}")
    res = {}
    with tempfile.TemporaryDirectory() as work:
        for side in ("peer", "kiln"):
            res[side] = run_side(side, model, Path(work))
            for r, got in enumerate(res[side]):
                print(f"{side} rank {r}: rise {got['rise'] / MiB:.0f} MiB ({got['rise'] / ckpt:.2f}x checkpoint, "
                      f"{got['rise'] / expected:.2f}x its share), holds {got['held'] / MiB:.0f} MiB (experts "
                      f"{got['expert_held'] / MiB:.0f} MiB, {', '.join(got['dtypes'])}), {got['seconds']:.1f} s; {load_average()}",
                      flush=True)
    same = all(abs(a["logits_sum"] - b["logits_sum"]) == 0 and a["logits_abs"] == b["logits_abs"]
               for a, b in zip(res["kiln"], res["peer"]))
    print(f"logits equal between the two loads: {same}")
    worst = {side: max(r["rise"] for r in res[side]) for side in res}
    report("FP8 MoE kept FP8, EP = 2: a rank's load peak RSS rise (read shard by shard vs whole load then shard)",
           "whole load", "loads/min", [60 / max(r["seconds"] for r in res["kiln"])],
           [60 / max(r["seconds"] for r in res["peer"])], kiln_mem=worst["kiln"] / MiB, peer_mem=worst["peer"] / MiB,
           goal="reported", note=f"checkpoint {ckpt / MiB:.0f} MiB, experts {experts / ckpt:.0%}; kiln rise "
                                 f"{worst['kiln'] / ckpt:.2f}x checkpoint ({worst['kiln'] / expected:.2f}x one rank's "
                                 f"share), whole load {worst['peer'] / ckpt:.2f}x; logits equal {same}")


if __name__ == "__main__":
    main()
