"""The GRPO family's arithmetic: advantages (group-relative, or RLOO's leave-one-out), the policy losses of TRL
1.16's GRPOTrainer (`loss_type` grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo), token- or sequence-level
importance weights (GSPO), and the importance-sampling correction against the sampler's log-probs.

The formulas are TRL 1.16's ("sum_then_normalize" aggregation):

- rewards r = sum_f w_f * r_f (NaN-skipping; a completion no function scored stays NaN); "group" advantages
  A = r - mean_group(r), divided by (std + 1e-4) unless scale_rewards = "none" (std unbiased, over the group
  or, "batch", over the whole batch); "rloo" advantages (TRL's RLOOTrainer) A = r - mean of the group's other
  rewards, optionally normalised over the batch; NaN advantages become 0;
- log-ratio = logp - logp_old per token ("token") or its masked mean per sequence ("sequence", GSPO); w = exp of it;
- per token: grpo / dr_grpo / dapo / bnpo / luspo: -min(w * A, clamp(w, 1 - eps_low, 1 + eps_high) * A), w first
  capped at `delta` when set (two-sided clipping); cispo: -detach(min(w, eps_high)) * A * logp; sapo:
  -sigmoid(tau (w - 1)) * 4 / tau * A (tau by the sign of A); vespo: -phi(w_seq) * A * logp with phi the Gamma
  weight of the sequence's summed log-ratio; rloo (TRL 1.16's RLOOTrainer): per sequence, w = exp of its summed
  log-ratio, -min(w * A, clamp(w, 1 - eps_low, 1 + eps_high) * A); then an off-policy sequence mask (DeepSeek-V3.2), the IS ratio, and
  beta * k3-KL (times w with use_bias_correction_kl);
- aggregation: grpo / sapo = mean over sequences of each sequence's token mean; dr_grpo = token sum / (sequences *
  max_new_tokens); dapo / cispo / vespo = token sum / tokens of the whole step (every micro-batch, every rank);
  bnpo = token sum / tokens of each micro-batch, then the mean over micro-batches; luspo = mean over sequences of
  each sequence's token sum; rloo = mean over sequences of each sequence's loss.

`loss_parts` gives each aggregation as the (loss_sum, count) pair the step engines sum over micro-batches and
ranks (kiln.train.engine): the step's loss, sum / count, is TRL's loss of the same generation batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "rloo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "rloo")
ScaleRewards = Literal["group", "batch", "none"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
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


def rloo_advantages(rewards: torch.Tensor, group: int, normalize: bool = False,
                    batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(N,) rewards -> RLOO's (N,) advantages: each reward less the mean of its scorable siblings' (TRL 1.16's
    RLOOTrainer); `normalize`: then (A - mean(A)) / (std(A) + 1e-4) over the batch (`batch_stats` = that
    (mean, std) over every rank, default this batch's). Unscorable completions (NaN) get 0."""
    grouped = rewards.view(-1, group)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    adv = rewards - ((total - grouped) / (scorable - 1)).view(-1)  # a lone scorable completion: 0/0 = NaN -> 0
    if normalize:
        mean, std = (torch.nanmean(adv), nanstd(adv)) if batch_stats is None else batch_stats
        adv = (adv - mean) / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0)


@dataclass(frozen=True)
class LossSpec:
    """The options of one GRPO-family loss (the [grpo] keys of the same names; defaults TRL 1.16's)."""
    loss_type: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    level: Literal["token", "sequence"] = "token"   # importance_sampling_level
    delta: float | None = None                       # two-sided clipping's cap on w (INTELLECT-2)
    beta: float = 0.0
    bias_correction_kl: bool = False                 # use_bias_correction_kl: the KL term times w
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None


@dataclass
class TokenLoss:
    loss: torch.Tensor          # (B, C) per-token loss (unmasked); (B, 1) broadcastable at sequence level
    ratio: torch.Tensor         # (B, C) or (B, 1): the importance weight w
    kl: torch.Tensor | None     # (B, C) the k3 estimate of KL(policy || reference), when beta != 0


def is_correction(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: ISMode,
                  clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """The importance-sampling ratio of the trainer's old log-probs over the sampler's (TRL's vLLM correction):
    per token (B, C) or per sequence (B, 1, the exp of the masked log-ratio sum); "*_truncate" clamps it to
    [clip_min, clip_max], "*_mask" zeroes it outside. A NaN sampler log-prob counts as no difference."""
    diff = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def off_policy_mask(adv: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """(B, 1): 0 for a sequence with A < 0 whose mean (sampler - current) log-prob is over `threshold`."""
    kl = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def gamma_weights(adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None,
                  spec: LossSpec) -> torch.Tensor:
    """(B, 1) VESPO's phi(w) = exp(lambda + k log w - lambda w) of the sequence's ratio (summed log-ratio, plus the
    IS ratio's log), k and lambda by the sign of A; no gradient (a scale on the log-prob's)."""
    floor = math.log(1e-8)
    seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + torch.sum(torch.clamp(torch.log(is_ratio), floor, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(seq, floor, 20.0)
    pos = adv >= 0
    k = torch.where(pos, spec.vespo_k_pos, spec.vespo_k_neg)
    lam = torch.where(pos, spec.vespo_lambda_pos, spec.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, adv: torch.Tensor, spec: LossSpec,
               ref_logps: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               is_ratio: torch.Tensor | None = None, sampler_logps: torch.Tensor | None = None) -> TokenLoss:
    """The per-token loss of `spec.loss_type` for logps, old_logps, ref_logps (B, C), advantages (B,), the loss
    mask (B, C) (needed at sequence level, for vespo and the off-policy mask), `is_ratio` (the IS correction,
    (B, C) or (B, 1)) and `sampler_logps` (the off-policy mask's; default old_logps)."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if spec.loss_type == "rloo":  # RLOO's ratio is the whole sequence's probability ratio
        log_w = (log_ratio * mask).sum(-1, keepdim=True)
    elif spec.level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    w = torch.exp(log_w)
    kl = None
    if spec.beta != 0.0:
        assert ref_logps is not None, "beta != 0 needs the reference log-probs"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if spec.bias_correction_kl:
            kl = kl * w
    kind = spec.loss_type
    if kind == "cispo":
        loss = -torch.clamp(w, max=spec.eps_high).detach() * adv * logps
    elif kind in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "rloo"):
        capped = w if spec.delta is None else torch.clamp(w, max=spec.delta)
        loss = -torch.min(capped * adv, torch.clamp(w, 1 - spec.eps_low, 1 + spec.eps_high) * adv)
    elif kind == "sapo":
        tau = torch.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (w - 1)) * 4 / tau * adv
    elif kind == "vespo":
        loss = -gamma_weights(adv, log_ratio, mask, is_ratio, spec) * adv * logps
    else:
        raise ValueError(f"unknown grpo.loss_type {kind!r} (one of {', '.join(LOSS_TYPES)})")
    if spec.off_policy_mask_threshold is not None:
        sampled = old_logps if sampler_logps is None else sampler_logps
        loss = loss * off_policy_mask(adv, logps, sampled, mask, spec.off_policy_mask_threshold)
    if is_ratio is not None and kind != "vespo":  # vespo folds it into its weight
        loss = loss * is_ratio
    if kl is not None:
        loss = loss + spec.beta * kl
    return TokenLoss(loss, w, kl)


def loss_parts(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, max_new_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) of one micro-batch for `loss_type`; summed over a step's micro-batches and ranks, their
    ratio is the aggregation the module docstring gives."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask  # a (B, 1) sequence-level loss broadcasts over the tokens
    rows = torch.tensor(float(mask.size(0)), dtype=torch.float64)
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    if loss_type == "dr_grpo":
        return masked.sum() / max_new_tokens, rows
    if loss_type in ("dapo", "cispo", "vespo"):
        return masked.sum(), mask.sum().to(torch.float64)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), torch.ones((), dtype=torch.float64)
    if loss_type == "luspo":
        return masked.sum(), rows
    if loss_type == "rloo":  # one loss per sequence (B, 1), counted whatever its mask (as TRL's mean over them)
        return per_token[:, 0].sum(), rows
    raise ValueError(f"unknown grpo.loss_type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")


def clipped(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """(B, C) or (B, 1) bool: weights the clip held (below 1 - eps_low with A < 0, above 1 + eps_high with A > 0)."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    return ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
