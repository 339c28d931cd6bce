"""Logit distillation of a Qwen3-shaped student from a Qwen3-shaped teacher through `kiln train` ([distill]) vs TRL
1.16's GKDTrainer (trl.experimental.gkd) with lmbda = 0 (the data's completions, no generation), same rows and
settings, CPU.

TRL 1.16 has two: DistillationTrainer (trl.trainer) always generates the student's completions (on-policy only),
and GKDTrainer mixes the data's completions with generations by `lmbda`. The comparison here is the distillation
step itself (both models' forwards, the divergence, the student's backward) on the same tokens, so GKDTrainer at
lmbda = 0; kiln's on-policy fraction (`lmbda`) samples on its generation engine, which bench_grpo.py times.

The models and data are bench_dpo.py's: Qwen3 layout, vocabulary 151,936, hidden 512, 4 layers, tied embeddings,
random weights built by transformers (student seed 0, teacher seed 1, saved once); chatterbot-corpus dialogs as
chat rows (the first turn, then its reply: the reply is trained), a 4,000-token byte-level BPE. Full-weight
student, the generalized JSD with beta 0.5 (GKD's default) at temperature 1 (the temperature GKDTrainer's loss
uses), batch 4 rows, max_length 128, AdamW lr 1e-5, fp32; TRL's gradient checkpointing off (SFTConfig turns it on
by default; kiln does not checkpoint), bf16 off.

kiln runs what `kiln train --config run.toml` runs (build_trainer + fit) with data.pack = false, so that a step
holds the same 4 rows as TRL's (SFT's packing, kiln's default, would put several rows in each of the 4 and run
the optimizer step once for more tokens); TRL runs GKDTrainer.train() (its ChatML collator, padded rows). Each side in its own process; rounds interleave; tokens/s
counts real (unpadded) tokens of the timed steps (all but the first `--warmup`): kiln's step records, TRL's
collator's attention masks. Peak memory is the process's peak RSS above what it held before the run. Ratio last.

    python benchmarks/bench_distill.py [--steps 3] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dpo import BATCH, LR, MAX_LENGTH, SIZE, kiln_rate, prepare, timed_rate
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

BETA = 0.5


def distill_data(tmp: Path) -> None:
    """rows.jsonl: each pair's prompt and chosen reply as a chat; teacher/: the same shape, other weights."""
    import torch
    import transformers

    rows = [json.loads(line) for line in (tmp / "pairs.jsonl").read_text().splitlines()]
    (tmp / "rows.jsonl").write_text("".join(json.dumps({"messages": r["prompt"] + r["chosen"]}) + "\n"
                                            for r in rows))
    shutil.copytree(tmp / "model", tmp / "teacher")  # the tokenizer files; the weights replaced below
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).save_pretrained(tmp / "teacher")


def run_kiln(tmp: Path, steps: int, warmup: int) -> dict:
    return kiln_rate(tmp, "causal-lm", "rows.jsonl", f"[distill]\nteacher = \"{tmp / 'teacher'}\"\nbeta = {BETA}",
                     steps, warmup, data="pack = false")


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    rows = [json.loads(line) for line in (tmp / "rows.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    teacher = transformers.AutoModelForCausalLM.from_pretrained(tmp / "teacher")
    args = GKDConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=BATCH,
                     max_length=MAX_LENGTH, lmbda=0.0, beta=BETA, learning_rate=LR, max_steps=steps + warmup,
                     bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0, gradient_checkpointing=False)
    collate = DataCollatorForChatML(tokenizer=tok, max_length=MAX_LENGTH)
    seen = [0]

    def counted(examples):  # the real tokens of each batch the trainer draws
        batch = collate(examples)
        seen[0] += int(batch["attention_mask"].sum())
        return batch

    stamps: list[tuple[float, int]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append((time.perf_counter(), seen[0]))

    trainer = GKDTrainer(model=model, teacher_model=teacher, args=args, data_collator=counted,
                         train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return {"tokens_per_s": timed_rate(stamps, warmup), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-distill-") as tmp:
        prepare(Path(tmp), BATCH * (a.steps + a.warmup))
        distill_data(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers, student and teacher; generalized JSD (beta {BETA}), "
          f"chatterbot chats (<= {MAX_LENGTH} tokens), batch {BATCH} rows")
    report("Logit distillation, full-weight student (kiln train [distill], Qwen3 shape, vocab 151,936)",
           "TRL 1.16 GKDTrainer (lmbda 0)", "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p), goal=">= 1.5x")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), int(steps), int(warmup))))
    else:
        main()
