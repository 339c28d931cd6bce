"""KTO of a Qwen3-shaped model through `kiln train` ([kto]) vs TRL 1.16's KTOTrainer, same rows and settings, CPU.

The model and data are bench_dpo.py's: Qwen3 layout, vocabulary 151,936, hidden 512, 4 layers, tied embeddings,
random weights built by transformers and saved once; chatterbot-corpus pairs unpaired into KTO rows (each pair
gives its chosen reply as a desirable row and its rejected one as an undesirable row), conversational, a 4,000-token
byte-level BPE. Full weights, loss "kto" (the KL reference point from each batch's rotated completions), beta 0.1,
the reference a frozen copy of the starting weights on both sides, batch 4 rows, max_length 128, AdamW lr 1e-5, fp32.

kiln runs what `kiln train --config run.toml` runs (build_trainer + fit, its fast path); TRL runs
KTOTrainer.train() (its fused LM head; bf16 off, as kiln runs fp32). Each side runs in its own process; rounds
interleave; tokens/s counts real (unpadded) prompt + completion tokens of the timed steps (all but the first
`--warmup`; the KL sequences are not counted on either side). Peak memory is the process's peak RSS above what it
held before the run. Ratios last.

    python benchmarks/bench_kto.py [--steps 3] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dpo import BATCH, LR, MAX_LENGTH, kiln_rate, prepare, timed_rate
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

BETA = 0.1


def unpair(tmp: Path) -> None:
    """rows.jsonl: each pair's chosen reply as a desirable row, then its rejected one as an undesirable row."""
    rows = []
    for line in (tmp / "pairs.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True},
                 {"prompt": r["prompt"], "completion": r["rejected"], "label": False}]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_kiln(tmp: Path, steps: int, warmup: int) -> dict:
    return kiln_rate(tmp, "causal-lm", "rows.jsonl", f"[kto]\nbeta = {BETA}", steps, warmup)


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    rows = [json.loads(line) for line in (tmp / "rows.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    args = KTOConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=BATCH,
                     max_length=MAX_LENGTH, beta=BETA, learning_rate=LR, max_steps=steps + warmup, bf16=False,
                     use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0)
    stamps: list[tuple[float, int]] = []
    trainer: KTOTrainer | None = None

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # TRL counts each step's attention-mask tokens
            stamps.append((time.perf_counter(), trainer._total_train_tokens))

    trainer = KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return {"tokens_per_s": timed_rate(stamps, warmup), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kto-") as tmp:
        prepare(Path(tmp), BATCH * (a.steps + a.warmup))  # two rows per pair: every row is seen at most once
        unpair(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; full-weight KTO (beta {BETA}), frozen-copy reference, "
          f"chatterbot rows (<= {MAX_LENGTH} tokens), batch {BATCH} rows")
    report("KTO full weights, frozen-copy reference (kiln train, Qwen3 shape, vocab 151,936)", "TRL 1.16 KTOTrainer",
           "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p), goal=">= 1.5x")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), int(steps), int(warmup))))
    else:
        main()
