"""Preference-optimization losses on sequence log-probs: DPO (sigmoid), hinge, IPO, SimPO, ORPO.

Each takes the policy's summed completion log-probs of the chosen and rejected replies (and their
token counts), the reference's where the loss has one, and returns per-pair losses and the rewards
logged beside them. The formulas are TRL 1.16's:
- sigmoid, hinge, ipo: `DPOTrainer._compute_loss` (trl.trainer.dpo_trainer); IPO divides each log-ratio
  by its completion's token count, as TRL does. `label_smoothing` on sigmoid is conservative DPO
  (cDPO): TRL 1.16's DPO sigmoid has no smoothing (it uses it in "robust"/"exo_pair"), so the two agree
  at the default 0; its older releases and its CPO trainer smooth sigmoid this way.
- simpo: `CPOTrainer.cpo_loss` with loss_type "simpo" (trl.experimental.cpo): length-averaged log-probs,
  margin `gamma`, no reference, no NLL term (cpo_alpha = 0).
- orpo: `ORPOTrainer` (trl.experimental.orpo): length-averaged log-probs, the log odds ratio weighted by
  `lambda` (TRL's ORPO `beta`), plus the NLL of the whole chosen sequence (prompt included, as TRL
  computes it), a mean over the micro-batch's chosen tokens.

`Signal` counts, step by step, the samples that carried a learning signal (DPO's and reward models' pairs whose
sides differ, KTO's rows with a completion token, GRPO's groups whose rewards differ) for the metrics, and
warns once in a run at a step where none did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn import functional as F

from kiln.parallel.world import World, all_reduce_sum

LossType = Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"]
REFERENCE_FREE = ("simpo", "orpo")
LEARNS_CHOSEN = ("orpo",)  # a loss with an NLL term on the chosen reply: a pair with chosen = rejected still teaches
__all__ = ["REFERENCE_FREE", "LossType", "PairLosses", "Signal", "differing_pairs", "log1mexp", "preference_losses"]


def differing_pairs(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(B,) bool: the pairs whose chosen and rejected sequences differ (equal ones carry no preference)."""
    c, r = batch["chosen_len"], batch["rejected_len"]
    width = min(batch["chosen_ids"].size(1), batch["rejected_ids"].size(1))
    at = torch.arange(width, device=c.device)[None, :]
    both = (at < c[:, None]) & (at < r[:, None])
    differ = ((batch["chosen_ids"][:, :width] != batch["rejected_ids"][:, :width]) & both).any(1)
    return differ | (c != r)


class Signal:
    """The samples of each step that carried a learning signal: `add` per micro-batch, `log` at the step (every
    rank's, as `<unit>_with_signal` in the record); a step where none did is warned about once per run."""

    def __init__(self, unit: str, why: str):
        self.unit, self.why = unit, why
        self.counts = torch.zeros(2, dtype=torch.float64)  # carried, of
        self.warned = False

    def add(self, carried: torch.Tensor) -> None:
        self.counts += torch.tensor([float(carried.sum()), float(carried.numel())], dtype=torch.float64)

    def log(self, record: dict[str, Any], world: World, device: torch.device, step: int) -> None:
        carried, of = all_reduce_sum(self.counts.to(device, copy=True), world).cpu().tolist()
        self.counts.zero_()
        record[f"{self.unit}_with_signal"] = int(carried)
        self.check(carried, of, step, world.main)

    def check(self, carried: float, of: float, step: int, main: bool) -> str | None:
        """The warning when none of `of` > 0 samples carried signal (once per run; printed on the main process)."""
        if self.warned or carried > 0 or of == 0:
            return None
        self.warned = True
        line = (f"warning: step {step}: none of its {int(of)} {self.unit} carried a learning signal ({self.why}); "
                f"a run of such steps learns nothing")
        if main:
            print(line, flush=True)
        return line


@dataclass
class PairLosses:
    losses: torch.Tensor            # (B,) per pair; the step's loss is their mean
    chosen_rewards: torch.Tensor    # (B,) detached
    rejected_rewards: torch.Tensor  # (B,) detached
    chosen_logps: torch.Tensor      # (B,) detached: what the loss compares (sums; averages for simpo / orpo)
    rejected_logps: torch.Tensor


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: expm1 near 0, log1p below -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_losses(loss_type: LossType, chosen: torch.Tensor, rejected: torch.Tensor,
                      chosen_count: torch.Tensor, rejected_count: torch.Tensor, *,
                      ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None,
                      beta: float = 0.1, label_smoothing: float = 0.0, gamma: float = 0.5, lam: float = 0.1,
                      chosen_nll: torch.Tensor | None = None) -> PairLosses:
    """Per-pair losses for `loss_type` from summed completion log-probs (B,) and token counts (B,).

    `ref_chosen` / `ref_rejected`: the reference's summed log-probs (sigmoid, hinge, ipo). `chosen_nll`:
    ORPO's NLL term, a scalar (the mean over the chosen sequences' tokens), added to every pair's loss.
    """
    chosen, rejected = chosen.float(), rejected.float()
    if loss_type in REFERENCE_FREE:
        chosen_avg = chosen / chosen_count.clamp(min=1)
        rejected_avg = rejected / rejected_count.clamp(min=1)
        if loss_type == "simpo":
            z = (chosen_avg - rejected_avg) - gamma / beta
            losses = -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing
            scale = beta
        else:
            if chosen_nll is None:
                raise ValueError("orpo needs chosen_nll, the NLL of the chosen sequences")
            log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
            losses = chosen_nll - lam * F.logsigmoid(log_odds)
            scale = lam
        return PairLosses(losses, scale * chosen_avg.detach(), scale * rejected_avg.detach(),
                          chosen_avg.detach(), rejected_avg.detach())
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"loss_type {loss_type!r} needs the reference's log-probs")
    chosen_ratio = chosen - ref_chosen.float()
    rejected_ratio = rejected - ref_rejected.float()
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        ipo = chosen_ratio / chosen_count.clamp(min=1) - rejected_ratio / rejected_count.clamp(min=1)
        losses = (ipo - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; one of sigmoid, ipo, hinge, simpo, orpo")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(),
                      chosen.detach(), rejected.detach())
