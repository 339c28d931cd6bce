"""`kiln plan` against measured peak RSS for QLoRA runs on a 4-bit base, CPU.

The model: bench_load_q4.py's cached Qwen3-shaped bf16 checkpoint (8 layers, hidden 1024, vocab 32,000, untied,
~310 MiB) with bench_load.py's BPE tokenizer beside it (symlinked into a work directory), run two ways: quantized
at load (`[model] quantize = "nf4"`) and as the bitsandbytes-4bit directory kiln writes from it. Each through the
real command (`kiln train`, `kiln launch --nproc-per-node 2` with `fsdp = true`), LoRA r=16 on all seven
projections, bench_load.py's rows (2 steps of 1 x 64 tokens per rank) and its VmHWM hook; beside each, `kiln
plan`'s prediction for the same TOML. Ratios last: measured / plan.

    python benchmarks/bench_plan_q4.py [--layers 8] [--batch 1] [--max-length 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load as bl
import bench_load_q4 as bq
from common import report

GiB = 1024 ** 3


def with_tokenizer(src: Path, tokenizer_from: Path, out: Path) -> Path:
    out.mkdir()
    for f in list(src.iterdir()) + [p for p in tokenizer_from.iterdir() if p.name.startswith(("tokenizer", "special"))]:
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=bl.BATCH, help="rows per rank (bench_load's 1)")
    ap.add_argument("--max-length", type=int, default=bl.MAX_LENGTH, help="tokens per row (bench_load's 64; its "
                    "rows are longer than 96 tokens, so every row is full up to that)")
    a = ap.parse_args()
    bl.BATCH, bl.MAX_LENGTH = a.batch, a.max_length
    bf16, nf4 = bq.build(bq.shape(a.layers))
    tok = bl.build_checkpoint("dense")
    write_toml = bl.write_toml
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-plan-q4-") as tmp:
        work = Path(tmp)
        chats = bl.write_chats(work)
        for label, src, quantize in (("quantize nf4 at load", bf16, True), ("bitsandbytes-4bit directory", nf4, False)):
            model = with_tokenizer(src, tok, work / f"m-{src.name}")
            bl.write_toml = lambda *args, q=quantize, **kw: _quantized(write_toml(*args, **kw), q)
            for run in (bl.Run("QLoRA, 1 process", "dense", 1, bl.ALL_LINEAR, {}),
                        bl.Run("FSDP2 + QLoRA, 2 processes", "dense", 2, bl.ALL_LINEAR, {"fsdp": True})):
                print(f"{label}, {run.name}: load {bl.load()}", flush=True)
                res = bl.run_kiln(run, model, chats, work)
                cfg = bl.write_toml(work, run, model, chats)
                plan = _plan(cfg, run.nproc)
                worst = max(res["peaks"])
                terms = ", ".join(f"{k} {v / 2 ** 20:.0f}" for k, v in plan.terms.items())
                print(f"  peak RSS per rank {', '.join(f'{p / GiB:.3f}' for p in res['peaks'])} GiB; plan "
                      f"{plan.total / GiB:.3f} GiB ({terms} MiB);"
                      f" measured / plan {worst / plan.total:.2f}; load {bl.load()}", flush=True)
                rows.append((f"{label}, {run.name}", worst, plan.total))
    for name, worst, planned in rows:
        report(f"kiln plan vs peak RSS, {name} (Qwen3 {a.layers} layers, hidden 1024, {a.batch} x {a.max_length} tokens)", "kiln plan (predicted)",
               "GiB", [worst / GiB], [planned / GiB], kiln_mem=worst / 2 ** 20, peer_mem=planned / 2 ** 20,
               goal="within 20%", note="ratio = measured / kiln plan")


def _plan(cfg: Path, nproc: int):
    """`kiln plan --config cfg --nproc nproc`'s largest rank (kiln.cli.plan's own inputs)."""
    from kiln.cli.plan import plan_inputs
    from kiln.parallel.memory import plan_memory
    from kiln.train.config import load_run_config

    params, dims, s, sizes, _ = plan_inputs(load_run_config(cfg, []), nproc, "cpu", str(cfg))
    return plan_memory(params, dims, s, sizes).peak


def _quantized(path: Path, quantize: bool) -> Path:
    if quantize:
        path.write_text(path.read_text().replace('task = "causal-lm"\n', 'task = "causal-lm"\nquantize = "nf4"\n', 1))
    return path


if __name__ == "__main__":
    main()
