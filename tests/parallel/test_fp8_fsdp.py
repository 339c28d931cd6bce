"""FSDP2 with FP8 training linears: the float32 master weights shard as usual, and the sharded FP8 forward
and backward equal the unsharded ones (gloo, 2 ranks).

A frozen FP8 checkpoint base (fp8="keep") crosses the collectives as bytes: test_fp8_keep_fsdp.py.
Not covered here: FP8 all-gather of trained weights (torchao's
`enable_fsdp_float8_all_gather`) needs torchao and a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.spawn import spawn


def _model() -> nn.Module:
    from kiln.models.common.fp8_train import swap_fp8_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 160), nn.Linear(160, 8))
    swap_fp8_linears(model)
    return model


def _check(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    ref, sharded = _model(), _model()
    ref(x).square().sum().backward()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    assert sharded[0].weight.to_local().shape == (160 // world, 64)
    y = sharded(x)
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)
    y.square().sum().backward()
    for (n, p), (_, r) in zip(sharded.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.slow
def test_fsdp2_shards_fp8_training_linears():
    spawn(_check, 2)
