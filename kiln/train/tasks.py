"""The default step and eval for kiln task models, and device choice.

A step returns `(loss_sum, count)`: the loss summed over the units it averages (examples, or
non-ignored tokens for token-level tasks) and how many there were. The Trainer divides by the
count summed over the whole accumulation window (and all ranks), so k micro-batches give the
gradient of one k-times batch even when their token counts differ.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.parallel.world import World, all_reduce_sum

StepResult = tuple[torch.Tensor, torch.Tensor | int]
StepFn = Callable[[nn.Module, dict], Any]
TOKEN_TASKS = ("token-classification", "masked-lm", "causal-lm")


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto`: cuda (this process's local rank), then mps, then cpu; otherwise the named device."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KilnError(f"train.device {name!r} is not a device name (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"train.device is {name!r} but no CUDA device is available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # through DDP


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("labels", "start_positions", "end_positions")}


def _loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor | int, Any]:
    task = getattr(_inner(model), "task", None)
    if task in TOKEN_TASKS and "labels" in batch:
        out = model(**_inputs(batch))
        logits, labels = out.logits, batch["labels"]  # (B, T, V), (B, T)
        if task == "causal-lm":  # predict token t+1 from t
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        count = (labels != -100).sum()
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # MoE load balancing (output_router_logits): weighted per token like the loss it joins
            loss_sum = loss_sum + _inner(model).config.router_aux_loss_coef * aux * count
        return loss_sum, count, out
    out = model(**batch)
    if getattr(out, "loss", None) is None:
        raise KilnError("the model returned no loss for this batch; give the batch labels or pass step=")
    n = next(iter(batch.values())).size(0)
    return out.loss * n, n, out


def default_step(model: nn.Module, batch: dict) -> StepResult:
    """The task model's own loss; token-level tasks summed over non-ignored tokens."""
    loss_sum, count, _ = _loss(model, batch)
    return loss_sum, count


def as_sum_and_count(result: Any, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
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
    """eval_loss (per unit, as in training) and eval_accuracy for the classification/QA heads."""
    model.eval()
    task = getattr(_inner(model), "task", None)
    sums = torch.zeros(4, dtype=torch.float64)  # loss_sum, loss_count, correct, judged
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss_sum, count, out = _loss(model, batch)
        sums[0] += float(loss_sum)
        sums[1] += float(count)
        if task == "sequence-classification" and batch["labels"].dtype == torch.long:
            sums[2] += float((out.logits.argmax(-1) == batch["labels"]).sum())
            sums[3] += batch["labels"].numel()
        elif task == "token-classification":
            keep = batch["labels"] != -100
            sums[2] += float((out.logits.argmax(-1)[keep] == batch["labels"][keep]).sum())
            sums[3] += float(keep.sum())
        elif task == "question-answering":
            hit = (out.start_logits.argmax(-1) == batch["start_positions"]) & \
                  (out.end_logits.argmax(-1) == batch["end_positions"])
            sums[2] += float(hit.sum())
            sums[3] += hit.numel()
    model.train()
    sums = all_reduce_sum(sums, world)
    metrics = {"eval_loss": float(sums[0] / sums[1].clamp(min=1))}
    if sums[3] > 0:
        metrics["eval_accuracy"] = float(sums[2] / sums[3])
    return metrics
