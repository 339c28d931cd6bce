"""BERT-base train step at a fixed shape: kiln (exact path and fast path) vs transformers, CPU.

BERT-base (12 layers, hidden 768) with a 2-way sequence-classification head, random weights built by
transformers and loaded by kiln; batch 2 x 128 tokens, no padding; one step = forward, backward and
a fused AdamW step, the same optimizer on every side. kiln's fast path is what the Trainer turns on
by default (`set_fast`, plus per-block torch.compile when parallel.compile is on); for this head no
fast piece differs from the exact path, so the two kiln rows measure the same code twice (a noise
floor). All three run in one process, step by step interleaved, after one warm-up step each.

    python benchmarks/bench_bert_step.py [--batch 2] [--seq 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report, setup_torch

SIZE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
            max_position_embeddings=512, num_hidden_layers=12, num_labels=2)


def main() -> None:
    import torch
    import transformers

    from kiln.models import load_pretrained
    from kiln.models.common.fast import set_fast
    from kiln.train.optim import adamw, param_groups

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    setup_torch()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**SIZE)).train()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        exact = set_fast(load_pretrained(tmp, task="sequence-classification"), False).train()
        fast = set_fast(load_pretrained(tmp, task="sequence-classification"), True).train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(5, 30000, (a.batch, a.seq), generator=g),
             "attention_mask": torch.ones(a.batch, a.seq, dtype=torch.long),
             "labels": torch.randint(0, 2, (a.batch,), generator=g)}
    sides = {name: (m, adamw(param_groups(m, 0.0), 1e-5)) for name, m in (("hf", hf), ("exact", exact), ("fast", fast))}

    def step(name: str) -> float:
        model, opt = sides[name]
        t = time.perf_counter()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for name in sides:
        step(name)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(a.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # who goes first rotates: load drifts within a round
            rates[name].append(a.batch / step(name))
    print(f"BERT-base, 2-way head, batch {a.batch} x {a.seq}, fused AdamW; kiln exact "
          f"{max(rates['exact']):.2f} samples/s, kiln fast {max(rates['fast']):.2f}, "
          f"transformers {max(rates['hf']):.2f}")
    flops = 6 * a.seq * (12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 12 * a.seq * 768)  # per sample
    report("BERT-base train step, fixed shape (kiln exact)", "transformers", "samples/s", rates["exact"], rates["hf"],
           flops_per_unit=flops, goal="report fast vs exact")
    report("BERT-base train step, fixed shape (kiln fast)", "transformers", "samples/s", rates["fast"], rates["hf"],
           flops_per_unit=flops, goal=">= 1.1x",
           note=f"fast/exact {max(rates['fast']) / max(rates['exact']):.3f}")


if __name__ == "__main__":
    main()
