"""[parallel] pp and cp under `kiln launch` on CUDA (nccl, one process per GPU): the loss curve equals one
process on the same batches within GPU rounding. Skipped without 2 GPUs (every CPU figure of these plans
is in test_kiln_train_pipeline.py and test_kiln_train_cp.py, whose run files these reuse)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.parallel import test_kiln_train_cp as cp_run
from tests.parallel import test_kiln_train_pipeline as pp_run
from tests.parallel.sft_runs import losses as _losses
from tests.parallel.sft_runs import make_data

RUNS = [("pp-1f1b", pp_run, {"pp": 2}), ("pp-interleaved", pp_run, {"pp": 2, "pp_schedule": "interleaved"}),
        ("cp-allgather", cp_run, {"cp": 2}), ("cp-ring", cp_run, {"cp": 2, "cp_method": "ring"}),
        ("cp-fsdp", cp_run, {"cp": 2, "fsdp": True})]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("gpu-runs"), pp_run.CHATS, pp_run.HELD_OUT)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name, module, parallel", RUNS, ids=[r[0] for r in RUNS])
def test_pp_and_cp_on_gpus_equal_one_process(data, name, module, parallel):
    one = module._toml(data, f"{name}-one", {})
    build_trainer(load_run_config(one)).fit()  # device "auto": this process's GPU
    p = module._launch(module._toml(data, name, parallel))
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = _losses(data / name), _losses(data / f"{name}-one")
    assert len(got) == len(want) == module.STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-4)
