"""Users' reward functions cannot hang or kill a [grpo] run: one that sleeps forever is abandoned after
grpo.reward_timeout (None rewards, counted in reward_timeouts) or, after grpo.reward_max_failures calls in a row,
stops the run by message; one that raises is counted in reward_errors the same way; SIGTERM while a reward function
sleeps abandons it after usercode.STOP_GRACE and the stop's checkpoint is written within 10 s; the table's checks name
the key."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.train import load_run_config, preempt
from kiln.train import usercode as envs
from kiln.train.metrics import read_metrics
from kiln.train.rewards import Reward, RewardGuard
from kiln.train.run import build_trainer
from tests.kiln_cli import REPO
from tests.train.test_grpo_recipe import _toml, grpo_dir  # noqa: F401  (grpo_dir: the shared tiny GRPO folder)

STOPPED = 75  # kiln.cli.common.EXIT_STOPPED

SLOW = '''
import os, time
from pathlib import Path

def sleepy(prompts, completions, **columns):
    marker = os.environ.get("KILN_TEST_REWARD_MARKER")
    if marker:
        Path(marker).write_text("in the reward")
    while True:
        time.sleep(1)

def oops(prompts, completions, **columns):
    raise ValueError("bad column")
'''


@pytest.fixture(scope="module")
def slow_dir(grpo_dir):
    (grpo_dir / "slowrewards.py").write_text(SLOW)
    return grpo_dir


def _run(d: Path, name: str, rewards: list[str], steps: int, **grpo) -> list[dict]:
    cfg = load_run_config(_toml(d, name, steps=steps),
                          overrides=[("grpo.rewards", rewards), *((f"grpo.{k}", v) for k, v in grpo.items())])
    build_trainer(cfg).fit()
    return [r for r in read_metrics(d / name / "metrics.jsonl") if "reward" in r]


def test_a_reward_that_sleeps_forever_gives_none_and_the_run_goes_on(slow_dir, capsys):
    t0 = time.monotonic()
    rows = _run(slow_dir, "sleepy-on", ["myrewards:share_low", "slowrewards:sleepy"], steps=2, reward_timeout=0.5)
    took = time.monotonic() - t0
    assert len(rows) == 2 and all(r["reward_timeouts"] == 1 for r in rows), rows  # one call per rollout
    assert all(math.isfinite(r["reward"]) for r in rows)  # share_low still scores every completion
    err = capsys.readouterr().err
    assert err.count("reward function 'sleepy' (slowrewards:sleepy) did not return within 0.5 s "
                     "(grpo.reward_timeout)") == 2, err
    assert took < 60, took  # two abandoned 0.5 s waits, not a hang


def test_a_reward_that_sleeps_forever_stops_the_run_after_n_in_a_row(slow_dir):
    with pytest.raises(KilnError, match=r"stopping: reward function 'sleepy' \(slowrewards:sleepy\) failed 2 calls "
                                        r"in a row \(grpo.reward_max_failures = 2, grpo.reward_timeout = 0.3 s\); the "
                                        r"last: .*did not return within 0.3 s .*prompts.jsonl:\d+"):
        _run(slow_dir, "sleepy-stop", ["myrewards:share_low", "slowrewards:sleepy"], steps=4, reward_timeout=0.3,
             reward_max_failures=2)


def test_a_reward_that_raises_is_counted_and_then_stops(slow_dir, capsys):
    rows = _run(slow_dir, "oops-on", ["myrewards:share_low", "slowrewards:oops"], steps=2)
    assert [r["reward_errors"] for r in rows] == [1, 1] and "reward_timeouts" not in rows[0]
    assert "reward function 'oops' (slowrewards:oops) raised ValueError: bad column" in capsys.readouterr().err
    with pytest.raises(KilnError, match=r"failed 1 calls in a row .* raised ValueError: bad column"):
        _run(slow_dir, "oops-stop", ["slowrewards:oops"], steps=2, reward_max_failures=1)


def test_well_behaved_rewards_log_no_failure_counts(slow_dir):
    rows = _run(slow_dir, "fine", ["myrewards:share_low"], steps=1)
    assert not any(k in rows[0] for k in ("reward_errors", "reward_timeouts")), rows


def test_failures_in_a_row_reset_on_success():
    calls = []

    def flaky(prompts, completions, **_):
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("odd call")
        return [1.0] * len(completions)

    guard, r = RewardGuard(5.0, 2), Reward("flaky", flaky, 1.0, spec="m:flaky")
    kwargs = {"prompts": ["p"], "completions": ["c"], "completion_ids": [[1]]}
    for _ in range(3):  # fail, succeed, fail...: never two in a row
        assert guard.call(r, 1, "f:1", kwargs) == [None]
        assert guard.call(r, 1, "f:1", kwargs) == [1.0]
    assert guard.take() == (3, 0) and guard.take() == (0, 0)


def test_a_signal_abandons_running_user_code_after_the_grace(monkeypatch):
    monkeypatch.setattr(preempt, "_CAUGHT", "SIGTERM")
    assert envs.call_user(lambda x: x + 1, 1, timeout=60, what="quick") == 2  # ends within the grace: kept
    t0 = time.monotonic()
    with pytest.raises(envs.Abandoned, match=r"still running 2 s after the run was told to stop \(SIGTERM\)"):
        envs.call_user(time.sleep, 30, timeout=60, what="sleeper")
    assert envs.STOP_GRACE <= time.monotonic() - t0 < envs.STOP_GRACE + 5
    guard = RewardGuard(60, 1)  # abandoned on a stop: None, and not a failure (max_failures = 1 would stop)
    assert guard.call(Reward("s", lambda **_: time.sleep(30), 1.0, spec="m:s"), 2, "f:1", {}) == [None, None]
    assert guard.take() == (0, 0)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_reward_timeout_must_be_finite_and_positive(slow_dir, value):
    with pytest.raises(Exception, match="grpo.reward_timeout must be a finite number of seconds > 0"):
        load_run_config(_toml(slow_dir, "bad-timeout"), overrides=[("grpo.reward_timeout", float(value))])


@pytest.mark.slow
def test_sigterm_while_a_reward_sleeps_saves_within_10_s(slow_dir, tmp_path):
    """reward_timeout = 60 s: without the abandonment the stop would wait a minute for the step in flight."""
    cfg = _toml(slow_dir, "sleepy-term", grpo="reward_timeout = 60.0", steps=5)
    cfg.write_text(cfg.read_text().replace('rewards = ["myrewards:share_low"]',
                                           'rewards = ["myrewards:share_low", "slowrewards:sleepy"]', 1))
    marker = tmp_path / "in-reward"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KILN_TEST_REWARD_MARKER": str(marker)}
    p = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "train", "--config", str(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120  # start-up (imports, the tiny model) on a loaded machine
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the reward function was never called:\n{p.communicate(timeout=30)}"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        saved = slow_dir / "sleepy-term" / "ckpt-000001"  # renamed into place once complete (atomic)
        while not saved.is_dir() and p.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        took = time.monotonic() - t0
        out, err = p.communicate(timeout=60)
        exited = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    # 2 s of grace (usercode.STOP_GRACE), the rest of a tiny step and its save: about 3 s on an idle machine
    print(f"SIGTERM to checkpoint: {took:.2f} s, to exit: {exited:.2f} s")  # the figures, shown with -s
    assert p.returncode == STOPPED, (p.returncode, out, err)
    assert took < 10, took
    assert "still running 2 s after the run was told to stop (SIGTERM)" in err, err
    assert "stopped by SIGTERM at step 1; checkpoint ckpt-000001" in out, out
    assert (slow_dir / "sleepy-term" / "ckpt-000001").is_dir()
