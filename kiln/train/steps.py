"""The default step and eval of the Trainer: each asks the model's Task (kiln.models.tasks).

A step returns `(loss_sum, count)`: the loss summed over the units it averages (examples, or
non-ignored tokens for token-level tasks) and how many there were. The Trainer divides by the
count summed over the whole accumulation window (and all ranks), so k micro-batches give the
gradient of one k-times batch even when their token counts differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from kiln.models.tasks import BASE, task_of
from kiln.parallel.world import World, all_reduce_sum

StepResult = tuple[torch.Tensor, torch.Tensor | int]
# What a step may return: (loss_sum, count), a mean loss over the micro-batch's rows, or {name: loss} for a run
# with several objectives (kiln.train.multiobjective).
StepReturn = StepResult | torch.Tensor | dict[str, torch.Tensor]
StepFn = Callable[[nn.Module, dict[str, Any]], StepReturn]


def default_step(model: nn.Module, batch: dict) -> StepResult:
    """The task model's own loss; token-level tasks summed over non-ignored tokens."""
    loss_sum, count, _ = (task_of(model) or BASE).loss(model, batch)
    return loss_sum, count


def sum_losses(losses: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A step's {name: loss} added up in name order (the same graph on every rank and every step)."""
    names = sorted(losses)
    total = losses[names[0]]
    for name in names[1:]:
        total = total + losses[name]
    return total


def as_sum_and_count(result: StepResult | torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept `(loss_sum, count)` or a plain mean loss (weighted by the micro-batch's size)."""
    if isinstance(result, tuple):
        loss_sum, count = result
    else:
        n = next(iter(batch.values())).size(0) if batch else 1
        loss_sum, count = result * n, n
    count = torch.as_tensor(count, dtype=torch.float64)
    return loss_sum, count


@torch.no_grad()
def default_evaluate(model: nn.Module, batches: Iterable[dict], device: torch.device, world: World,
                     autocast: Callable[[], Any]) -> dict[str, float]:
    """eval_loss (per unit, as in training) and eval_accuracy for the heads that score one."""
    model.eval()
    task = task_of(model) or BASE
    sums = torch.zeros(4, dtype=torch.float64)  # loss_sum, loss_count, correct, judged
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss_sum, count, out = task.loss(model, batch)
        sums[0] += float(loss_sum)
        sums[1] += float(count)
        scored = task.score(out, batch)
        if scored is not None:
            sums[2] += scored[0]
            sums[3] += scored[1]
    model.train()
    sums = all_reduce_sum(sums, world)
    metrics = {"eval_loss": float(sums[0] / sums[1].clamp(min=1))}
    if sums[3] > 0:
        metrics["eval_accuracy"] = float(sums[2] / sums[3])
    return metrics
