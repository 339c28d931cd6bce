"""DeepSeek-V4's blocks carry hc_mult residual streams (B, T, n, C), a rope dict and token ids: per-block activation
checkpointing recomputes them bit for bit; FSDP2 with it, and FSDP2 with expert parallelism, equal one process
(spawned, gloo); a tp that would split an output group of heads is refused by name (tp = 2 and tp x ep
parity: tests/parallel/test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import workers
from tests.spawn import spawn

JOBS = [("fsdp-ac-2-deepseek-v4", "deepseek_v4", {"fsdp": True, "activation_checkpointing": "block"}),
        ("fsdp-ep-2-deepseek-v4", "deepseek_v4", {"fsdp": True, "ep": 2})]  # expert shards: FSDP units of their own


def test_block_checkpointing_recomputes_the_streams_exactly():
    from kiln.parallel.apply import parallelize

    plain = workers.reference("deepseek_v4")
    model = workers.build("deepseek_v4")
    parallelize(model, workers.plan(activation_checkpointing="block"), world_size=1)
    recomputed = [b for b in model.model.layers if "forward" in vars(b)]  # the plan swaps forward per instance
    assert len(recomputed) == len(model.model.layers)
    got = workers.step(model, workers.batch())
    assert torch.equal(got["loss"], plain["loss"])
    assert set(got["grads"]) == set(plain["grads"])
    for name, grad in plain["grads"].items():
        assert torch.equal(got["grads"][name], grad), name


def test_tensor_parallel_needs_whole_output_groups_per_rank():
    from kiln.errors import ConfigError
    from kiln.parallel.tp import tensor_plan

    model = workers.build("deepseek_v4")  # 4 heads in o_groups = 2 groups: tp = 2 keeps whole groups, 4 cannot
    assert tensor_plan(model, 2).head_params
    with pytest.raises(ConfigError, match=r"parallel.tp = 4 does not divide the model's o_groups \(2\)"):
        tensor_plan(model, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("v4-plans")
    spawn(workers.run_many, 2, (str(out), JOBS))
    return {p.stem: torch.load(p, weights_only=True) for p in out.glob("*.pt")}


@pytest.mark.slow
@pytest.mark.parametrize("name", [j[0] for j in JOBS])
def test_fsdp_plans_equal_one_process(results, name):
    got, want = results[name], workers.reference("deepseek_v4")
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    # gradients only: the hyper-connection weights get gradients far below AdamW's eps (~1e-9), where the
    # first step's size follows the fp32 rounding of FSDP's reduction, so updated weights are not comparable
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
