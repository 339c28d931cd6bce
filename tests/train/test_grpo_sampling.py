"""What makes a GRPO step fast stays exact: the rollout's inverse-CDF draw samples the softmax (and never a token
of probability 0), its packed decode head gives the model's own logits to fp32 rounding, and a tied embedding's
coalesced gradient is, element for element, the one the dense backward makes, added into the head's in place."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.models.common.fast import set_fast
from kiln.models.common.tied_grad import coalesce_tied_gradient, deferred_head
from kiln.models.generation import inverse_cdf
from kiln.train.logps import token_logps
from tests.train.test_dpo_logps import tiny_lm


def _sigmas(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    """The largest |empirical - expected| frequency over the vocabulary, in binomial stds."""
    p = (probs / probs.sum()).double()
    std = (p * (1 - p) / draws).sqrt().clamp(min=1 / draws)
    return float(((counts / draws - p).abs() / std).max())


def test_inverse_cdf_draws_the_distribution_and_never_a_zero():
    probs = torch.rand(50, generator=torch.Generator().manual_seed(0)) ** 3  # unnormalised, uneven
    probs[[0, 7, 49]] = 0.0  # the first, a middle and the last entry impossible
    draws = 50_000
    for block in (8, 1024):  # 7 blocks, the last one short; one block (a block wider than the row)
        tokens = inverse_cdf(probs.expand(draws, -1), torch.Generator().manual_seed(1), block)  # a row per draw
        counts = torch.bincount(tokens, minlength=50).double()
        assert counts[[0, 7, 49]].sum() == 0
        # 50 frequencies, each within 5 binomial stds (a two-sided 5-sigma miss: ~6e-7 per entry)
        assert _sigmas(counts, probs, draws) < 5
        assert _sigmas(counts, probs.flip(0), draws) > 5  # the control: another distribution fails the same check
        again = inverse_cdf(probs.expand(draws, -1), torch.Generator().manual_seed(1), block)
        assert torch.equal(tokens, again)  # seeded


@pytest.mark.parametrize("defer", [False, True])
def test_tied_gradient_is_the_dense_ones_sum_added_in_place(defer):
    """Two micro-batches of repeated ids and pad ids (0) accumulate the same gradient, bit for bit, as the dense
    embedding backward (with `defer`, the head's weight gradient made after the backbone's, its chunks but the
    kept one recomputed); the head's gradient tensor itself becomes .grad (the lookup's rows went into it)."""
    plain = tiny_lm(tied=True)
    set_fast(plain)
    switched = copy.deepcopy(plain)
    assert coalesce_tied_gradient(switched, defer_head_grad=defer)
    g = torch.Generator().manual_seed(3)
    micro = [torch.randint(0, 6, (3, 9), generator=g) for _ in range(2)]  # 6 ids over 27 places: many repeats
    for model in (plain, switched):
        for ids in micro:
            mask = (ids != 0).long()
            logps = token_logps(model, ids, mask, mask, chunk=4)  # 4 rows of logits at a time: several chunks
            (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), switched.parameters()):
        assert b.grad.layout == torch.strided and torch.equal(a.grad, b.grad), name
    # in place: the weight gradient deferred_head's node passes on is the one that becomes .grad (with `defer`
    # the head itself returned a zero-stride placeholder and the node made it); the control: the same head taken
    # after the lookup (its node then runs first, before the sparse rows come) ends in a new tensor
    ids, mask = micro[0], (micro[0] != 0).long()
    targets = torch.where(mask.bool(), torch.roll(ids, -1, 1), -100)
    for before, same in ((True, True), (False, False)):
        switched.zero_grad(set_to_none=True)
        head = deferred_head(switched) if before else None
        hidden = switched.model(input_ids=ids, attention_mask=mask)
        head = head if before else deferred_head(switched)
        seen, placeholders = [], []
        head.register_hook(lambda grad: placeholders.append(grad.stride() == (0, 0)))
        head.grad_fn.register_hook(lambda grads_in, grads_out: seen.append(grads_in[0].data_ptr()))
        switched.hidden_token_logps(hidden, targets, chunk=4, head=head).sum().backward()
        assert placeholders == [defer]
        assert (seen == [switched.output_weight.grad.data_ptr()]) is same
