"""Controls for the tensor-parallel parity cases, and the token shares of the routed experts under tp.

Without the MLA plan's `shared_by_heads` entry (the shared rope key's gradient summed over tp ranks)
tp = 2 on deepseek_v3 no longer equals one process, so test_parity's `tp-2-deepseek` case is able to
fail where that sum goes missing. Under tp each rank runs the routed experts on its share of the
tokens: the split and the gather (and their backward) hold for row counts tp does not divide.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.parallel import workers
from tests.spawn import spawn


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


def _shares_round_trip(rank: int, world: int, out: str) -> None:
    from kiln.parallel.tp import _GatherRows, _row_sizes, _TakeRows

    x = torch.arange(5 * 3, dtype=torch.float32).view(5, 3).requires_grad_()  # 5 rows over 2 ranks: 3 + 2
    sizes = _row_sizes(5, world)
    mine = _TakeRows.apply(x, sizes, rank, None)
    whole = _GatherRows.apply(mine * (rank + 1), sizes, rank, None)  # each rank scales its own rows
    whole.sum().backward()
    if rank == 0:
        torch.save({"sizes": sizes, "mine": mine.detach(), "whole": whole.detach(), "grad": x.grad},
                   os.path.join(out, "shares.pt"))


@pytest.mark.slow
def test_expert_token_shares_split_and_gather_uneven_rows(tmp_path):
    spawn(_shares_round_trip, 2, (str(tmp_path),))
    got = torch.load(os.path.join(tmp_path, "shares.pt"), weights_only=True)
    x = torch.arange(15, dtype=torch.float32).view(5, 3)
    assert got["sizes"] == [3, 2]
    assert torch.equal(got["mine"], x[:3])
    assert torch.equal(got["whole"], torch.cat([x[:3], 2 * x[3:]]))  # every rank's rows, in rank order
    # d(sum)/dx: each row's own rank's scale, gathered whole on every rank
    assert torch.equal(got["grad"], torch.cat([torch.ones(3, 3), 2 * torch.ones(2, 3)]))
