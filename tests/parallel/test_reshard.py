"""A checkpoint resumed on another number of processes reshards instead of being refused.

An FSDP run on 2 gloo processes, SIGKILLed after step 3 (ckpt-000002 the newest), resumes on 1 and on 4
processes: DCP reads the sharded model and optimizer state into the new layout, the per-process batch
changes so the global batch keeps its rows, and the losses equal the uninterrupted 2-process run within
fp32 rounding; the 1-process continuation resumes again on 1 process and on 4 (its plain checkpoint into
FSDP shards). A plain (DDP) checkpoint does the same. What cannot reshard is refused by message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.train.resume import check_resume, plan_reshard
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import losses, make_data, weights, write_toml

STEPS, GLOBAL_BATCH = 6, 4


def _launch(n: int, cfg: Path, *extra: str, env: dict | None = None):
    return kiln_cli("launch", "--nproc-per-node", str(n), "--", "train", "--config", str(cfg), *extra, env=env)


def _killed_and_straight(d: Path, name: str, parallel: dict) -> tuple[Path, Path]:
    """An uninterrupted 2-process run and its twin SIGKILLed after step 3 (newest checkpoint: step 2)."""
    straight = write_toml(d, f"{name}-straight", GLOBAL_BATCH // 2, parallel, steps=STEPS)
    assert _launch(2, straight).returncode == 0
    cfg = write_toml(d, name, GLOBAL_BATCH // 2, parallel, steps=STEPS)
    p = _launch(2, cfg, env={"KILN_FAULT": "step:3"})
    assert p.returncode != 0 and (d / name / "ckpt-000002").is_dir() and not (d / name / "ckpt-000004").exists()
    return cfg, d / f"{name}-straight"


def _resume_on(n: int, cfg: Path, killed: Path, run: Path, from_step: int = 2):
    shutil.copytree(killed, run)
    for late in (p for p in run.glob("ckpt-*") if int(p.name.removeprefix("ckpt-")) > from_step):
        shutil.rmtree(late)  # a finished run: continue it from `from_step`
    p = _launch(n, cfg, "--resume", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"from ckpt-{from_step:06d}" in p.stdout
    return p


def _continues(run: Path, straight: Path, tmp: Path) -> None:
    got, want = losses(run), losses(straight)
    assert len(got) == STEPS and got[:2] == want[:2]  # the steps before the checkpoint are kept as logged
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    a, b = weights(run / f"ckpt-{STEPS:06d}", tmp), weights(straight / f"ckpt-{STEPS:06d}", tmp)
    assert a.keys() == b.keys()
    for k in a:  # AdamW moves near-zero gradients by about lr * sign: fp32 rounding shows as ~1e-5 there
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_fsdp_checkpoint_from_2_processes_resumes_on_1_and_on_4(tmp_path):
    d = make_data(tmp_path)
    cfg, straight = _killed_and_straight(d, "fsdp", {"fsdp": True})
    for n, per_process in ((1, 4), (4, 1)):
        run = d / f"fsdp-on-{n}"
        p = _resume_on(n, cfg, d / "fsdp", run)
        line = (f"resharding checkpoint from 2 to {n} processes: train.batch_size 2 -> {per_process} per process "
                f"keeps the global batch of {GLOBAL_BATCH} rows")
        assert line in p.stdout
        notes = [r["note"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "note" in r]
        assert any(line in note for note in notes)
        _continues(run, straight, tmp_path)
    # the 1-process run saved plain checkpoints of 4 rows per process; run.toml still says 2 (for 2 processes)
    p = _resume_on(1, cfg, d / "fsdp-on-1", d / "fsdp-1-again", from_step=4)
    assert "resume: train.batch_size 2 -> 4 per process, as ckpt-000004 was trained" in p.stdout
    assert "resharding" not in p.stdout
    _continues(d / "fsdp-1-again", straight, tmp_path)
    # and scaled back up to 4 FSDP processes from its step 4: whole weights and optimizer state into shards
    p = _resume_on(4, cfg, d / "fsdp-on-1", d / "fsdp-1-then-4", from_step=4)
    assert "resharding checkpoint from 1 to 4 processes: train.batch_size 4 -> 1 per process" in p.stdout
    _continues(d / "fsdp-1-then-4", straight, tmp_path)


@pytest.mark.slow
def test_ddp_checkpoint_from_2_processes_resumes_on_1(tmp_path):
    d = make_data(tmp_path)
    cfg, straight = _killed_and_straight(d, "ddp", {})
    p = _resume_on(1, cfg, d / "ddp", d / "ddp-on-1")
    assert "resharding checkpoint from 2 to 1 processes: train.batch_size 2 -> 4 per process" in p.stdout
    _continues(d / "ddp-on-1", straight, tmp_path)


# ---- what cannot reshard, by message (no processes needed) --------------------------------------
def _state(world: int, batch_size: int = 2, **parallel) -> dict:
    fingerprint = {"model": {"shapes": {"w": [4, 4]}, "dtypes": ["float32"]}, "data": {"train": "a.jsonl"},
                   "precision": "fp32", "world_size": world}
    return {"fingerprint": fingerprint, "run_config": {"train": {"batch_size": batch_size, "lr": 0.01, "seed": 5},
                                                       "parallel": {"dp": 0, "tp": 1, "ep": 1, **parallel}}}


def _run(world: int, batch_size: int, **parallel) -> tuple[dict, dict]:
    state = _state(world, batch_size, **parallel)
    return state["fingerprint"], state["run_config"]


def test_same_world_size_is_no_reshard_and_other_sizes_keep_the_global_batch():
    old = _state(2)
    assert plan_reshard(Path("ckpt"), old, _run(2, 2)[1], 2, 2) is None
    r = plan_reshard(Path("ckpt"), old, _run(4, 2)[1], 4, 4)
    assert (r.batch_size, r.global_batch, r.old_world, r.new_world) == (1, 4, 2, 4)
    # tp = 2 on both sides: 4 -> 8 processes is 2 -> 4 data-parallel ranks
    r = plan_reshard(Path("ckpt"), _state(4, 4, tp=2), _run(8, 4, tp=2)[1], 8, 4)
    assert (r.batch_size, r.global_batch) == (2, 8)


def test_resharding_refuses_what_cannot_carry_over_by_message():
    with pytest.raises(KilnError, match=r"reshards over data parallelism only \(dp, fsdp\), but parallel.tp 1 -> 2"):
        plan_reshard(Path("ckpt"), _state(2), _run(4, 2, tp=2)[1], 4, 2)
    with pytest.raises(KilnError, match=r"global batch of 4 rows \(2 per process x 2 data-parallel processes\) does "
                                        r"not split evenly over 3 data-parallel processes"):
        plan_reshard(Path("ckpt"), _state(2), _run(3, 2)[1], 3, 3)
    with pytest.raises(KilnError, match=r"\[parallel.cadence\] checkpoint holds one data cursor per process"):
        plan_reshard(Path("ckpt"), _state(2, cadence={}), _run(4, 2, cadence={})[1], 4, 4)


def test_a_resharded_resume_needs_the_batch_size_that_keeps_the_global_batch():
    fingerprint, config = _run(4, 2)  # the per-process batch kept at 2: the global batch would double
    with pytest.raises(KilnError, match=r"resharding checkpoint from 2 to 4 processes needs train.batch_size = 1 "
                                        r"per process to keep the global batch of 4 rows, but this run has 2"):
        check_resume(Path("ckpt"), _state(2), fingerprint, config, 4)
    fingerprint, config = _run(4, 1)
    reshard, notes = check_resume(Path("ckpt"), _state(2), fingerprint, config, 4)
    assert reshard.batch_size == 1 and notes == []  # the batch size change is the reshard's, not a note
    config["train"]["lr"] = 0.02
    assert check_resume(Path("ckpt"), _state(2), fingerprint, config, 4)[1] == ["train.lr 0.01 -> 0.02"]
    config["train"]["seed"] = 1
    with pytest.raises(KilnError, match=r"train.seed 5 -> 1"):
        check_resume(Path("ckpt"), _state(2), fingerprint, config, 4)
