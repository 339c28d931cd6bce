"""examples/agent end to end, shortened: the warm-up SFT, then multi-turn GRPO against its guessing game; the
mean episode reward over the last steps is above the first steps' by more than three standard errors of the
difference, the error taken from the run's own step-to-step scatter (not from a value seen once)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent" / "run.py"
SFT_STEPS, GRPO_STEPS, WINDOW = 150, 30, 8


def _mean_var(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


@pytest.mark.slow  # SFT 150 steps + GRPO 30 steps of 64 episodes: several minutes on two loaded cores
def test_the_agent_examples_reward_rises(tmp_path):
    spec = importlib.util.spec_from_file_location("agent_example_run", EXAMPLE)
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    rows = run.main(["--root", str(tmp_path), "--sft-steps", str(SFT_STEPS), "--grpo-steps", str(GRPO_STEPS)])
    rewards = [r["reward"] for r in rows]
    assert len(rewards) == GRPO_STEPS and all(math.isfinite(x) for x in rewards)
    (first, v1), (last, v2) = _mean_var(rewards[:WINDOW]), _mean_var(rewards[-WINDOW:])
    se = math.sqrt(v1 / WINDOW + v2 / WINDOW)
    assert last - first > 3 * se, (first, last, se, rewards)
    assert (tmp_path / "runs" / "agent" / "rollouts.jsonl").is_file()
