"""The causal-LM loss, in one place: next-token targets, the summed form, and transformers' mean.

`shift_labels` turns labels aligned with the inputs into next-token targets (token t predicts
t+1; the last position predicts nothing). `lm_loss_sum` is what training accumulates: the fp32
cross entropy summed over the non-ignored targets, and their count, so micro-batches and ranks
add up to one exact mean. `causal_lm_loss` is the mean a task model returns as `.loss` for
`labels=`, computed in the same order as transformers' causal-LM loss so the two are bit-identical.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "lm_loss_sum", "shift_labels"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) next-token targets: labels[:, 1:] with IGNORE_INDEX at the last position."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross entropy summed over targets != IGNORE_INDEX, that count) for logits (B, T, V), targets (B, T)."""
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, (targets != IGNORE_INDEX).sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross entropy of token t+1 given tokens <= t, from unshifted labels (B, T).

    The order of operations is transformers' (upcast, shift, flatten, mean over the non-ignored),
    so a model's `.loss` equals theirs to the last bit.
    """
    targets = shift_labels(labels).view(-1).to(logits.device)  # (B*T,)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets, ignore_index=IGNORE_INDEX)
