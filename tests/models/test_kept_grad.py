"""KeptGradEmbedding (kiln.models.common.kept_grad): the weight gradient summed into a kept buffer is bitwise torch's
dense embedding gradient (the same sums: index_add_ in token order, the padding id left out) step after step in
both zero_grad modes, with an AdamW step between, and the buffer is the same tensor every step; accumulated over
micro-batches it is the same terms summed in another association (each batch's rows added to the running sum,
not to a fresh matrix first): within float32 rounding of the terms' absolute sum; what it refuses to switch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kiln.models.common.kept_grad import KeptGradEmbedding, keep_embedding_gradient


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_equals_the_dense_backward_across_steps(set_to_none):
    torch.manual_seed(0)
    plain = nn.Embedding(50, 8, padding_idx=1)
    kept = copy.deepcopy(plain)
    assert keep_embedding_gradient(kept) and isinstance(kept, KeptGradEmbedding)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, kept)]
    g = torch.Generator().manual_seed(1)
    buffers = set()
    for _ in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
        ids = torch.randint(0, 12, (3, 7), generator=g)  # ids repeat and include the padding id
        w = torch.randn(3, 7, 8, generator=g)
        for m in (plain, kept):
            (m(ids) * w).sum().backward()
        assert torch.equal(kept.weight.grad, plain.weight.grad)
        assert float(kept.weight.grad[1].abs().max()) == 0.0  # the padding row has no gradient
        buffers.add(kept.weight.grad.data_ptr())
        for opt in opts:
            opt.step()
        assert torch.equal(kept.weight, plain.weight)
    assert len(buffers) == 1  # one buffer, reused
    with torch.no_grad():  # no gradient: the plain lookup
        assert torch.equal(kept(torch.tensor([[2, 3]])), plain(torch.tensor([[2, 3]])))


def test_micro_batches_accumulate_within_rounding():
    torch.manual_seed(0)
    plain = nn.Embedding(50, 8, padding_idx=1)
    kept, size = copy.deepcopy(plain), copy.deepcopy(plain)
    keep_embedding_gradient(kept)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        ids = torch.randint(0, 12, (3, 7), generator=g)
        w = torch.randn(3, 7, 8, generator=g)
        for m, x in ((plain, w), (kept, w), (size, w.abs())):  # `size`: each element's sum of |terms|
            (m(ids) * x).sum().backward()
    terms = 4 * 3 * 7  # the most terms one element sums
    bound = 2 * terms * 2.0**-24 * size.weight.grad  # a sum's error <= (terms - 1) u sum|terms|, twice for headroom
    assert bool(((kept.weight.grad - plain.weight.grad).abs() <= bound).all())
    assert float(kept.weight.grad.abs().max()) > 1.0  # control: real sums were compared


def test_only_a_plain_trained_float_embedding_is_switched():
    assert not keep_embedding_gradient(nn.Embedding(10, 4, max_norm=1.0))
    assert not keep_embedding_gradient(nn.Embedding(10, 4, sparse=True))
    frozen = nn.Embedding(10, 4)
    frozen.weight.requires_grad_(False)
    assert not keep_embedding_gradient(frozen)
    assert not keep_embedding_gradient(nn.Linear(4, 4))
