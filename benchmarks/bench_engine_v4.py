"""DeepSeek-V4 on kiln's generation engine (kiln.engine.v4) against the model's own decode loop, on CPU.

The model is bench_deepseek_v4.py's DeepSeek-V4 shape (4 layers: sliding, CSA, HCA, CSA; hash then top-k MoE over
32 experts; 4 streams; hidden 512; window 128), built by kiln from config. Greedy decoding of NEW tokens after a
384-token prompt (past the window, 96 CSA and 24 HCA entries), the decode steps alone (a 1-token run in the same
round is subtracted), for 1 request and for BATCH requests at once (the loop: one static batch of equal-length
prompts; the engine: BATCH requests, continuous batching). Greedy tokens are checked equal first. Ratios
engine/loop are printed last (> 1: the engine is faster).

Run by hand (not in `make bench`): it compares kiln with kiln (the engine against the loop it replaces), no
outside peer; the engine's table row is bench_engine.py's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deepseek_v4 import SIZE
from common import report, setup_torch

PROMPT, NEW, BATCH = 384, 16, 8
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 2))


def _decode_only(run) -> float:
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    run(NEW)
    return (time.perf_counter() - t1) - (t1 - t0)


def main() -> None:
    from kiln.engine import Engine, SamplingParams
    from kiln.models.auto import AutoConfig, from_config

    setup_torch()
    model = from_config(AutoConfig.for_model("deepseek_v4", **SIZE), task="causal-lm", seed=0).eval()
    model.config.eos_token_id = None
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, SIZE["vocab_size"], (BATCH, PROMPT), generator=g)
    engine = Engine(model, block_size=16, max_seqs=BATCH, step_tokens=512)

    def loop(rows: int):
        return lambda n: model.generate(prompts[:rows], max_new_tokens=n)

    def eng(rows: int):
        return lambda n: engine.generate(prompts[:rows].tolist(), SamplingParams(max_tokens=n, temperature=0.0))

    with torch.no_grad():
        want = model.generate(prompts[:1], max_new_tokens=NEW)[0, PROMPT:].tolist()
    same = eng(1)(NEW)[0][0].token_ids == want
    print(f"DeepSeek-V4-shaped, {PROMPT}-token prompts + {NEW} greedy tokens; {ROUNDS} rounds; torch threads "
          f"{torch.get_num_threads()}; check: engine greedy tokens = the loop's {same}")
    if not same:
        sys.exit("the engine and the loop disagree: the timings below would compare different work")
    for rows in (1, BATCH):
        times: dict[str, list[float]] = {"loop": [], "engine": []}
        for _ in range(ROUNDS):
            times["loop"].append(_decode_only(loop(rows)))
            times["engine"].append(_decode_only(eng(rows)))
        report(f"DeepSeek-V4 greedy decode, {rows} request{'s' * (rows > 1)} ({PROMPT}-token prompts)",
               "kiln generate loop", "tokens/s", [rows * (NEW - 1) / s for s in times["engine"]],
               [rows * (NEW - 1) / s for s in times["loop"]], note="kiln.engine.v4 (exact, batch-invariant)")


if __name__ == "__main__":
    main()
