"""The GRPO family's arithmetic: group-relative advantages and the clipped policy loss (grpo, dr_grpo, dapo, bnpo).

The formulas are TRL 1.16's GRPOTrainer ("sum_then_normalize" aggregation, token-level importance sampling):

- rewards r = sum_f w_f * r_f (NaN-skipping; a completion no function scored stays NaN), advantages
  A = r - mean_group(r), divided by (std + 1e-4) unless scale_rewards = "none" (std unbiased, over the group
  or, "batch", over the whole batch); NaN advantages become 0;
- per token: ratio = exp(logp - logp_old), loss = -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A),
  plus beta * (exp(ref - logp) - (ref - logp) - 1) when beta != 0;
- aggregation: grpo = mean over sequences of each sequence's token mean; dr_grpo = token sum / (sequences *
  max_new_tokens); dapo = token sum / tokens of the whole step (every micro-batch, every rank); bnpo = token
  sum / tokens of each micro-batch, then the mean over micro-batches.

`loss_parts` gives each aggregation as the (loss_sum, count) pair the step engines sum over micro-batches and
ranks (kiln.train.engine): the step's loss, sum / count, is TRL's loss of the same generation batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(x)).sum()
    return (var * count / (count - 1)).sqrt()


def combine_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards per function -> (N,) weighted sums, NaN where no function scored the completion."""
    rewards = (per_func * weights[None, :]).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def advantages(rewards: torch.Tensor, group: int, scale: ScaleRewards, batch_std: torch.Tensor | None = None
               ) -> torch.Tensor:
    """(N,) rewards of N / group groups (consecutive) -> (N,) advantages. `batch_std`: the std over the whole
    batch (all ranks) for scale = "batch"; default that of `rewards`."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale == "group":
        adv = adv / (nanstd(grouped, dim=1).repeat_interleave(group) + STD_EPS)
    elif scale == "batch":
        std = nanstd(rewards) if batch_std is None else batch_std
        adv = adv / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0)


@dataclass
class TokenLoss:
    loss: torch.Tensor          # (B, C) per-token loss (unmasked)
    ratio: torch.Tensor         # (B, C) importance ratio exp(logp - logp_old)
    kl: torch.Tensor | None     # (B, C) the k3 estimate of KL(policy || reference), when beta != 0


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
               beta: float = 0.0, ref_logps: torch.Tensor | None = None) -> TokenLoss:
    """The clipped surrogate per token for logps, old_logps, ref_logps (B, C) and advantages (B,)."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta != 0 needs the reference log-probs"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = loss + beta * kl
    return TokenLoss(loss, ratio, kl)


def loss_parts(loss_type: LossType, per_token: torch.Tensor, mask: torch.Tensor, max_new_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) of one micro-batch for `loss_type`; summed over a step's micro-batches and ranks, their
    ratio is the aggregation the module docstring gives."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    rows = torch.tensor(float(per_token.size(0)), dtype=torch.float64)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    if loss_type == "dr_grpo":
        return masked.sum() / max_new_tokens, rows
    if loss_type == "dapo":
        return masked.sum(), mask.sum().to(torch.float64)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), torch.ones((), dtype=torch.float64)
    raise ValueError(f"unknown grpo.loss_type {loss_type!r}")


def clipped(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """(B, C) bool: tokens whose ratio the clip held (below 1 - eps_low with A < 0, above 1 + eps_high with A > 0)."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    return ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
