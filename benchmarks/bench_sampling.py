"""One sampling step on (32, 151,936) float32 logits: kiln.engine.sampling.sample vs what transformers'
`generate` does per step (its logits processors and warpers, softmax, torch.multinomial), same logits, CPU.

Run by hand (not in `make bench`): a micro-benchmark of one step of the engine's sampler, which bench_engine.py
measures inside whole generations; this one says which sampling option costs what.

Two kinds of logits: "peaked" (a head of 40 likely tokens over a N(0, 1.5^2) floor: a trained model's usual
step) and "flat" (N(0, 1): a random-weight model, the worst case for top-p, whose kept set is most of the
vocabulary). Each configuration: 32 rows with the same params, except "mixed" (a different option per row).
The peer applies the same options in transformers' order (repetition penalty, temperature, top-k, top-p,
min-p); transformers has no presence / frequency penalty, so "penalties" is repetition only on its side, and
its log-probs are a log_softmax and a topk. Times are the best of --reps calls (ms, wall-clock and process CPU time); the ratio printed last is
the geometric mean over the configurations of kiln's speed over the peer's in CPU time (> 1: kiln faster).

    python benchmarks/bench_sampling.py [--reps 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kiln.engine.params import SamplingParams as SP
from kiln.engine.sampling import request_generator, sample

B, V = 32, 151_936
CONFIGS = {
    "temperature 1": SP(),
    "greedy": SP(temperature=0.0),
    "top_p 0.95": SP(top_p=0.95),
    "top_k 50": SP(top_k=50),
    "min_p 0.05": SP(min_p=0.05),
    "T 0.7 top_k 20 top_p 0.9": SP(temperature=0.7, top_k=20, top_p=0.9),
    "log-probs + top 5": SP(logprobs=True, top_logprobs=5),
    "penalties": SP(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2),
}
MIXED = [SP(), SP(temperature=0.0), SP(top_p=0.95), SP(top_k=50), SP(min_p=0.05, logprobs=True),
         SP(temperature=0.7, top_k=20, top_p=0.9, logprobs=True, top_logprobs=5)]


def logits(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        return torch.randn(B, V, generator=g)
    x = torch.randn(B, V, generator=g) * 1.5
    head = torch.randint(0, V, (B, 40), generator=g)
    x.scatter_(1, head, torch.linspace(14, 6, 40).expand(B, -1).contiguous())
    return x


def peer_step(x: torch.Tensor, params: list[SP], prompt: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """transformers' per-step sampling: its processors over the rows sharing params, then multinomial."""
    out = torch.empty(B, dtype=torch.long)
    groups: dict[SP, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p, []).append(b)
    for p, rows in groups.items():
        idx = torch.tensor(rows)
        scores = x[idx]
        procs = LogitsProcessorList()
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if p.temperature > 0:
            if p.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                procs.append(TopKLogitsWarper(p.top_k))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(p.top_p))
            if p.min_p > 0:
                procs.append(MinPLogitsWarper(p.min_p))
        scores = procs(prompt[idx], scores)
        if p.temperature == 0:
            tok = scores.argmax(-1)
        else:
            tok = torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(1)
        out[idx] = tok
        if p.logprobs:
            lp = x[idx].log_softmax(-1)
            lp.gather(1, tok[:, None])
            if p.top_logprobs:
                lp.topk(p.top_logprobs, dim=-1)
    return out


def best_ms(fn, reps: int) -> tuple[float, float]:
    """The best wall-clock and the best process CPU time of `reps` calls, in ms (on a shared machine the CPU
    time is the steadier figure: it leaves out the time the process waited for a core)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(wall) * 1e3, min(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, V, (B, 200), generator=torch.Generator().manual_seed(1))
    prompts, outputs = prompt.tolist(), [row[:50] for row in prompt.tolist()]
    ratios = []
    print(f"{B} x {V} float32 logits, {args.threads} thread(s), best of {args.reps}; load average "
          + " / ".join(f"{v:.1f}" for v in os.getloadavg()))
    print(f"{'logits':7} {'config':26} {'kiln wall':>9} {'cpu':>7} {'peer wall':>9} {'cpu':>7} {'peer/kiln cpu':>13}")
    for kind in ("peaked", "flat"):
        x = logits(kind)
        for name, params in [*((n, [p] * B) for n, p in CONFIGS.items()),
                             ("mixed", [MIXED[b % len(MIXED)] for b in range(B)])]:
            gens = [request_generator(0, b, "cpu") for b in range(B)]
            k, kc = best_ms(lambda: sample(x, params, prompts, outputs, gens), args.reps)
            g = torch.Generator().manual_seed(0)
            p, pc = best_ms(lambda: peer_step(x, params, prompt, g), args.reps)
            ratios.append(pc / kc)
            print(f"{kind:7} {name:26} {k:9.2f} {kc:7.2f} {p:9.2f} {pc:7.2f} {pc / kc:13.2f}", flush=True)
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print("load average after: " + " / ".join(f"{v:.1f}" for v in os.getloadavg()))
    print(f"ratio kiln/transformers (speed in CPU time, geometric mean over {len(ratios)} configurations): {gm:.2f}")


if __name__ == "__main__":
    main()
