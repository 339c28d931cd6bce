"""GRPO's update with data.pack (a rollout micro-batch's prompt + completion sequences packed into rows, attention
kept per sequence: kiln.train.packing.completion_logps) vs the rollout's own padded rows (prompts left-padded,
completions right-padded: GRPORun.logps through the training forward), CPU, one process.

The work timed is the update of one micro-batch: the policy's log-probs of the completion tokens, the dapo loss
(TRL 1.16's default) against fixed old log-probs and advantages, and its backward, exactly what GRPOEngine runs
for each micro-batch after a rollout. The rollout is drawn, not sampled (the sampler is the same either way and is
timed by bench_grpo.py): 4 prompts x 4 completions; prompt lengths uniform in [30, 120] tokens; completion lengths
log-normal with median 90 and log-sigma 0.8, cut to [4, 256] (the budget, max_new_tokens = 256): the spread of a
group whose samples end at their own EOS, a few at the budget, as reasoning completions do.

The model: kiln's Qwen3, hidden 256, 6 layers, vocabulary 4,096, random weights, fp32, the chunked head (set_fast),
as bench_dpo_pack.py (a body-to-head cost per token like real models'). tokens/s counts the real (prompt +
completion) tokens of each update; rounds interleave the two sides; the first update of each side is warm-up.
The packed loss must equal the padded one within 1e-5 relative (checked). Ratio (packed / padded) last.

    python benchmarks/bench_grpo_pack.py [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, report, setup_torch

SIZE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=2)
PROMPTS, GROUP, BUDGET = 4, 4, 256


def rollout(rng: random.Random) -> dict:
    import torch

    prompts = [rng.randint(30, 120) for _ in range(PROMPTS)]
    seqs = [(p, max(4, min(BUDGET, round(math.exp(math.log(90) + 0.8 * rng.gauss(0, 1))))))
            for p in prompts for _ in range(GROUP)]
    P, C = max(prompts), max(c for _, c in seqs)
    ids = torch.zeros((len(seqs), P + C), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        ids[i, P - p: P + c] = torch.tensor([rng.randrange(3, SIZE["vocab_size"]) for _ in range(p + c)])
        attn[i, P - p: P + c] = 1
    return {"input_ids": ids, "attention_mask": attn, "prompt_len": P, "completion_mask": attn[:, P:].clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    setup_torch()
    import torch

    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.common.fast import set_fast
    from kiln.train.grpo_loss import LossSpec, loss_parts, token_loss
    from kiln.train.logps import token_logps
    from kiln.train.packing import completion_logps

    model = set_fast(from_config(AutoConfig.for_model("qwen3", **SIZE), task="causal-lm", seed=0)).train()
    rng = random.Random(0)
    micros = [rollout(rng) for _ in range(a.steps + 1)]
    spec = LossSpec()

    def padded(micro: dict) -> torch.Tensor:
        p, cmask = micro["prompt_len"], micro["completion_mask"]
        targets = torch.cat([torch.zeros_like(micro["input_ids"][:, :p]), cmask], 1)
        full = token_logps(model, micro["input_ids"], micro["attention_mask"], targets)
        return full[:, p - 1: p - 1 + cmask.size(1)]

    sides = {"padded": padded, "packed": lambda micro: completion_logps(model, micro)}
    fixed = []
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for m in micros:
            old = padded(m)
            fixed.append((old + 0.05 * torch.randn(old.shape, generator=g) * m["completion_mask"],
                          torch.randn(m["input_ids"].size(0), generator=g)))

    def update(side: str, i: int) -> float:
        m, (old, adv) = micros[i], fixed[i]
        t = token_loss(sides[side](m), old, adv, spec, None, m["completion_mask"])
        part, count = loss_parts("dapo", t.loss, m["completion_mask"], BUDGET)
        (part / count.float()).backward()
        model.zero_grad(set_to_none=True)
        return float(part.detach() / count)

    rates: dict[str, list[float]] = {"padded": [], "packed": []}
    losses: dict[str, list[float]] = {"padded": [], "packed": []}
    tokens = sum(int(m["attention_mask"].sum()) for m in micros[1:])
    for _ in range(a.rounds):
        for side in rates:
            losses[side] = [update(side, 0)]  # warm-up
            start = time.perf_counter()
            losses[side] += [update(side, i) for i in range(1, len(micros))]
            rates[side].append(tokens / (time.perf_counter() - start))
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses["packed"], losses["padded"]))
    print(f"losses, packed: {losses['packed']}; padded: {losses['padded']}; largest relative difference {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit(f"packed and padded losses differ by {worst:.2e} relative: not the same work")
    width = sum(m["input_ids"].numel() for m in micros[1:])
    print(f"Qwen3 shape, hidden 256, 6 layers, vocab 4,096; {PROMPTS} prompts x {GROUP} completions a micro-batch, "
          f"{a.steps} timed; real tokens {tokens} of {width} padded ({tokens / width:.0%}); {load_average()}")
    report("GRPO update packed vs padded, mixed completion lengths (data.pack)", "kiln padded (data.pack = false)",
           "tokens/s", rates["packed"], rates["padded"], goal="reported")


if __name__ == "__main__":
    main()
