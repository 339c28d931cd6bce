"""The one causal-LM loss: next-token targets, the summed form training accumulates, and the mean
that must equal transformers' ForCausalLMLoss to the last bit."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX as BOTTOM
from kiln.models.common.loss import IGNORE_INDEX, causal_lm_loss, lm_loss_sum, shift_labels


def _case(seed: int = 0, B: int = 3, T: int = 7, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = IGNORE_INDEX  # a prompt part without loss
    labels[2, -2:] = IGNORE_INDEX
    return logits, labels


def test_ignore_index_is_defined_once_and_re_exported():
    assert IGNORE_INDEX is BOTTOM and IGNORE_INDEX == -100


def test_shift_labels_moves_targets_one_left():
    labels = torch.tensor([[5, 6, 7, 8], [1, IGNORE_INDEX, 3, 4]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, IGNORE_INDEX], [IGNORE_INDEX, 3, 4, IGNORE_INDEX]]
    assert shift_labels(labels).is_contiguous()


def test_lm_loss_sum_is_the_summed_cross_entropy_and_its_count():
    logits, labels = _case()
    targets = shift_labels(labels)
    loss_sum, count = lm_loss_sum(logits.half(), targets)
    want = F.cross_entropy(logits.half().flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    assert loss_sum.dtype == torch.float32 and torch.equal(loss_sum, want)
    assert isinstance(count, torch.Tensor) and int(count) == int((targets != -100).sum()) == 3 * 7 - 3 - 1 - 3
    # the mean it stands for is transformers' mean (within rounding: sum then divide vs. the kernel's mean)
    torch.testing.assert_close(loss_sum / count, causal_lm_loss(logits.half(), labels), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_lm_loss_is_transformers_bit_for_bit(dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels = _case(seed=1)
    logits = logits.to(dtype)
    ours = causal_lm_loss(logits, labels)
    theirs = ForCausalLMLoss(logits, labels, vocab_size=logits.size(-1))
    assert torch.equal(ours, theirs), (ours.item(), theirs.item())
    control = causal_lm_loss(logits, torch.roll(labels, 1, dims=1))  # a test that can fail: other targets differ
    assert not torch.equal(control, theirs)
