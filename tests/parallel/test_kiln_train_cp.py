"""`kiln launch` with [parallel] cp = 2: the Trainer's run equals one process on the same batches (loss curve and
weights within fp32 rounding), and a run whose whole group is SIGKILLed and resumed ends bit-identical to the
uninterrupted one. Tiny qwen3 SFT from config on packed chat rows, whose lengths vary by batch (the split pads
them to a multiple of 2 * cp).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.hub import load_weights
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.parallel.sft_runs import launch as _launch
from tests.parallel.sft_runs import losses as _losses
from tests.parallel.sft_runs import make_data, run_toml

CHATS = [[{"role": "user", "content": f"what is {a} times {b}?"}, {"role": "assistant", "content": f"{a * b}."}]
         for a in range(6) for b in range(4)]
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("cp-train"), CHATS)


def _toml(d: Path, name: str, parallel: dict) -> Path:
    return run_toml(d, name, parallel, data={"max_length": 45}, train={"steps": STEPS, "keep_last": 5})


@pytest.mark.slow
def test_cp_run_equals_one_process_and_resumes_exactly_after_sigkill(setup):
    build_trainer(load_run_config(_toml(setup, "one", {}))).fit()
    one, cp = setup / "one", setup / "cp"
    p = _launch(_toml(setup, "cp", {"cp": 2}))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "parallel: cp 2 (DDP)" in p.stdout  # the split ran (two ranks on one batch would match one process too)
    assert len(_losses(cp)) == STEPS
    torch.testing.assert_close(torch.tensor(_losses(cp)), torch.tensor(_losses(one)), rtol=1e-5, atol=1e-6)
    end = f"ckpt-{STEPS:06d}"
    got, want = load_weights(cp / end / "model"), load_weights(one / end / "model")  # cp under DDP: plain saves
    start = load_weights(one / "ckpt-000002" / "model")
    assert any(not torch.equal(want[k], start[k]) for k in want)  # the run moved the weights
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")

    cfg, killed = _toml(setup, "cp-killed", {"cp": 2}), setup / "cp-killed"
    p = _launch(cfg, env={"KILN_FAULT": "step:3"})  # rank 0 SIGKILLed after step 3: torchrun ends the group
    assert p.returncode != 0
    assert (killed / "ckpt-000002").is_dir() and not (killed / end).exists()
    p = _launch(cfg, "--resume", str(killed))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from ckpt-000002" in p.stdout
    assert _losses(killed) == _losses(cp)  # bit for bit, not within rounding
    a, b = load_weights(cp / end / "model"), load_weights(killed / end / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_cp_with_fsdp_over_dp_x_cp_saves_sharded_checkpoints_that_resume(setup):
    """cp = 2 with fsdp: shards span the flattened dp x cp mesh and save as DCP; the run equals one process."""
    from kiln.parallel.checkpoint import export_sharded, is_sharded

    one = setup / "one-fsdp"
    build_trainer(load_run_config(_toml(setup, "one-fsdp", {}))).fit()
    cfg, run = _toml(setup, "cp-fsdp", {"cp": 2, "fsdp": True}), setup / "cp-fsdp"
    p = _launch(cfg, env={"KILN_FAULT": "step:3"})
    assert p.returncode != 0 and "parallel: cp 2 (FSDP)" in p.stdout
    p = _launch(cfg, "--resume", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from ckpt-000002" in p.stdout
    torch.testing.assert_close(torch.tensor(_losses(run)), torch.tensor(_losses(one)), rtol=1e-5, atol=1e-6)
    end = f"ckpt-{STEPS:06d}"
    assert is_sharded(run / end)
    got, want = load_weights(export_sharded(run / end, setup / "cp-fsdp-export")), load_weights(one / end / "model")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
