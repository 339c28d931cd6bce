"""Reward-model training of a Qwen3-shaped model through `kiln train` (model.task = "reward-model") vs TRL 1.16's
RewardTrainer, same pairs and settings, CPU.

The model and data are bench_dpo.py's: Qwen3 layout, vocabulary 151,936, hidden 512, 4 layers, tied embeddings,
random weights built by transformers and saved once as a causal LM (both sides read it as a one-label sequence
classifier, the score head freshly initialised); chatterbot-corpus preference pairs, conversational, a 4,000-token
byte-level BPE. Full weights, Bradley-Terry loss with center_rewards_coefficient 0.01, batch 4 pairs, max_length
128 (longer pairs dropped on both sides), AdamW lr 1e-5, fp32.

kiln runs what `kiln train --config run.toml` runs (build_trainer + fit; data.pack on, its default); TRL runs
RewardTrainer.train() (bf16 off, as kiln runs fp32). Where the time went before 2026-11-29 13:00 (one thread, wall
seconds per 4-pair step under load, torch.profiler): the body's matmuls ~1.3 s, the embedding's dense backward
~0.5 s (a fresh 151,936 x 512 fp32 gradient each step: its zero fill page-faults), AdamW 0.33 s, clipping and the
gradient scaling ~0.15 s. TRL pays all of these. kiln now runs its last layer only at each sequence's read
position (kiln.models.common.scored_tail: a quarter of this 4-layer body's products) and sums the embedding's
gradient into a kept buffer (kiln.models.common.kept_grad); packing drops the padding of these short pairs.
Each side runs in its own process; rounds interleave; tokens/s counts real (unpadded)
chosen + rejected tokens of the timed steps (all but the first `--warmup`). Peak memory is the process's peak RSS
above what it held before the run. Ratios last.

    python benchmarks/bench_reward.py [--steps 3] [--warmup 1] [--rounds 2]
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

CENTER = 0.01


def run_kiln(tmp: Path, steps: int, warmup: int) -> dict:
    return kiln_rate(tmp, "reward-model", "pairs.jsonl", f"[reward_model]\ncenter_rewards_coefficient = {CENTER}",
                     steps, warmup)


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    rows = [json.loads(line) for line in (tmp / "pairs.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    args = RewardConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=BATCH,
                        max_length=MAX_LENGTH, learning_rate=LR, max_steps=steps + warmup, bf16=False, use_cpu=True,
                        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                        center_rewards_coefficient=CENTER, dataloader_num_workers=0, seed=0)
    stamps: list[tuple[float, int]] = []
    trainer: RewardTrainer | None = None

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # TRL counts each step's attention-mask tokens
            stamps.append((time.perf_counter(), trainer._total_train_tokens))

    trainer = RewardTrainer(model=str(tmp / "model"), args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return {"tokens_per_s": timed_rate(stamps, warmup), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-reward-") as tmp:
        prepare(Path(tmp), 2 * BATCH * (a.steps + a.warmup))  # some pairs are longer than max_length: dropped
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; full-weight reward model (Bradley-Terry, center "
          f"{CENTER}), chatterbot pairs (<= {MAX_LENGTH} tokens), batch {BATCH} pairs")
    report("Reward model full weights (kiln train, Qwen3 shape, vocab 151,936)", "TRL 1.16 RewardTrainer",
           "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p), goal=">= 1.5x")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), int(steps), int(warmup))))
    else:
        main()
