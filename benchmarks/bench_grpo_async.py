"""[grpo] async = true against the synchronous run: bench_agent_grpo.py's multi-turn workload (the same Qwen3-shaped
model, TRL environment class, prompts, 2 prompts x 4 generations, 32 tokens an episode), kiln on both sides:
`async = true, max_staleness = 1, importance_sampling_correction = true` (the next rollout sampled by the
background worker while this one trains) vs the default synchronous run. tokens/s of prompt + completion tokens
per step, peak RSS above the baseline. Each side in its own process; rounds interleave; the ratio (async over
sync) last.

On a CPU the worker's sampling and the trainer's update share the cores (each with torch's intra-op threads), so
the overlap gains only what a step leaves idle; with OMP threads = cores it can lose to the contention. The
async run also pays a second forward per micro-batch (the trainer's old log-probs, as sampler = "exact") and a
weight copy per step.

Run by hand (not in `make bench`): a kiln-vs-kiln comparison of two modes, no peer library.

    python benchmarks/bench_grpo_async.py [--steps 4] [--warmup 1] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_grpo import prepare, run_kiln
from common import interleaved, report

ASYNC = "async = true\nmax_staleness = 1\nimportance_sampling_correction = true"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-async-") as tmp:
        prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup), sides=("sync", "async"))
    report("multi-turn GRPO, async = true (max_staleness 1) vs synchronous (kiln both)", "kiln synchronous",
           "tokens/s", [x["tokens_per_s"] for x in res["async"]], [x["tokens_per_s"] for x in res["sync"]],
           kiln_mem=min(x["peak_mb"] for x in res["async"]), peer_mem=min(x["peak_mb"] for x in res["sync"]))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        print(json.dumps(run_kiln(Path(tmp), int(steps), int(warmup), ASYNC if side == "async" else "")))
    else:
        main()
