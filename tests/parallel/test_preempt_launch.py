"""Preemption under `kiln launch` with 2 gloo processes: SIGTERM to the launcher at a random step reaches the ranks,
they agree on one stop step, write the (plain or sharded) checkpoint there and exit 75 with one line; resumed, the
run ends bit-identical to an uninterrupted one (DDP and FSDP). A second run on the locked directory is refused.

Tiny qwen3 SFT runs built from config (packed chat rows).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.parallel.checkpoint import is_sharded
from kiln.train import lock
from tests.kiln_cli import REPO, kiln_cli
from tests.parallel.sft_runs import losses, make_data, run_toml, weights

STEPS = 16
LINE = re.compile(r"^stopped by SIGTERM at step (\d+); checkpoint (ckpt-\d+); resume with the same command and "
                  r"--resume$", re.MULTILINE)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("preempt"))


def _toml(d: Path, name: str, parallel: dict) -> Path:
    return run_toml(d, name, parallel, train={"steps": STEPS, "batch_size": 1, "save_every": 8, "keep_last": 5})


def _launch_args(cfg: Path, *extra: str) -> list[str]:
    return ["launch", "--nproc-per-node", "2", "--", "train", "--config", str(cfg), *extra]


@pytest.fixture(scope="module")
def references(setup) -> dict[str, Path]:
    """Uninterrupted 2-process runs, DDP and FSDP."""
    runs = {}
    for name, parallel in (("ddp", {}), ("fsdp", {"fsdp": True})):
        p = kiln_cli(*_launch_args(_toml(setup, f"{name}-ref", parallel)))
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = setup / f"{name}-ref"
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"fsdp": True}], ids=["ddp", "fsdp"])
def test_sigterm_to_launcher_stops_every_rank_at_one_step(setup, references, tmp_path, parallel):
    name = "fsdp" if parallel else "ddp"

    cfg, run = _toml(setup, name, parallel), setup / name
    seed = random.randrange(10**6)
    target = random.Random(seed).randint(1, STEPS - 6)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *_launch_args(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.time() + 300
    while len(losses(run)) < target and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, f"seed {seed}: the run ended before the signal"
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, f"seed {seed}: {launcher.returncode}\n{out}\n{err[-3000:]}"
    lines = LINE.findall(out)
    assert len(lines) == 1, f"seed {seed}: one line, from rank 0:\n{out}"
    step = int(lines[0][0])
    assert target <= step < STEPS and lines[0][1] == f"ckpt-{step:06d}", out
    assert "ended with" not in err, err  # exit 75 is said by the line, not reported as a failure
    assert is_sharded(run / lines[0][1]) == bool(parallel)
    assert len(losses(run)) == step

    p = kiln_cli(*_launch_args(cfg, "--resume", str(run)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"from ckpt-{step:06d} (step {step})" in p.stdout
    _same_end(run, references[name], tmp_path)


def _same_end(run: Path, ref: Path, tmp: Path) -> None:
    assert losses(run) == losses(ref)  # bit for bit
    end = f"ckpt-{STEPS:06d}"
    a, b = weights(ref / end, tmp), weights(run / end, tmp)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("fault,rank,step", [("step:6", "1", 6), ("ckpt:8", "0", 8)], ids=["rank1-step6", "rank0-mid-ckpt8"])
def test_sigterm_to_one_rank_stops_both(setup, references, tmp_path, fault, rank, step):
    # One rank alone gets SIGTERM (rank 1 right after step 6; rank 0 while the shards of ckpt-000008 are on disk
    # and unsealed): the all-reduce after the step stops the other rank at the same step, checkpointed there.
    cfg, run = _toml(setup, f"fsdp-{fault.replace(':', '')}", {"fsdp": True}), setup / f"fsdp-{fault.replace(':', '')}"
    p = kiln_cli(*_launch_args(cfg), env={"KILN_FAULT": fault, "KILN_FAULT_SIGNAL": "SIGTERM", "KILN_FAULT_RANK": rank})
    assert p.returncode == 75, f"{p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    assert LINE.findall(p.stdout) == [(str(step), f"ckpt-{step:06d}")], p.stdout
    assert is_sharded(run / f"ckpt-{step:06d}") and len(losses(run)) == step
    p = kiln_cli(*_launch_args(cfg, "--resume", str(run)))
    assert p.returncode == 0, p.stderr[-3000:]
    _same_end(run, references["fsdp"], tmp_path)


@pytest.mark.slow
def test_locked_run_directory_refused_under_launch(setup, references):
    # rank 0 takes the lock; held here, the launched run is refused by rank 0's message and exits 1
    run = references["ddp"]
    held = lock.acquire(run)
    try:
        p = kiln_cli(*_launch_args(_toml(setup, "ddp-ref", {}), "--resume", str(run)))
    finally:
        held.release()
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"is in use by another kiln train (pid {os.getpid()} on " in p.stderr, p.stderr[-3000:]
