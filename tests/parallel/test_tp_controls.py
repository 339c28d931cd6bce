"""Controls for the tensor-parallel parity cases: without the MLA plan's `shared_by_heads` entry (the
shared rope key's gradient summed over tp ranks) tp = 2 on deepseek_v3 no longer equals one process, so
test_parity's `tp-2-deepseek` case is able to fail where that sum goes missing."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from spawn import spawn

import workers


def _without_shared_key(rank: int, world: int, out: str) -> None:
    import kiln.parallel.tp as tp

    declared = tp.plan_of
    tp.plan_of = lambda model: dataclasses.replace(declared(model), shared_by_heads=())
    workers.run_plan(rank, world, out, "tp-2-deepseek-no-shared-key", "deepseek_v3", {"tp": 2})


@pytest.mark.slow
def test_mla_tp_without_the_shared_key_sum_differs(tmp_path):
    spawn(_without_shared_key, 2, (str(tmp_path),))
    got = torch.load(os.path.join(tmp_path, "tp-2-deepseek-no-shared-key.pt"), weights_only=True)
    want = workers.reference("deepseek_v3")
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)  # the forward is unchanged
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    rope_rows = slice(workers.MODELS["deepseek_v3"]["kv_lora_rank"], None)  # the k_rope output rows
    assert not torch.allclose(got["grads"][name][rope_rows], want["grads"][name][rope_rows], rtol=1e-3, atol=1e-5)
