"""The same plans on CUDA with nccl, one process per GPU (up to 2); skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import workers
from tests.spawn import spawn


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("keys", [{"fsdp": True}, {"tp": 2}, {"fsdp": True, "param_dtype": "bf16"}],
                         ids=["fsdp", "tp", "fsdp-bf16"])
def test_plan_on_gpus_equals_one_cpu_process(tmp_path, keys):
    world = min(2, torch.cuda.device_count())
    if keys.get("tp", 1) > world:
        pytest.skip("tp = 2 needs 2 GPUs")
    spawn(workers.run_plan_cuda, world, (str(tmp_path), "gpu", "qwen3", keys), backend="nccl")
    got, want = torch.load(tmp_path / "gpu.pt", weights_only=True), workers.reference("qwen3")
    tol = dict(rtol=2e-2, atol=2e-2) if keys.get("param_dtype") == "bf16" else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got["loss"], want["loss"], **tol)
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, **tol)
