"""AdamW with the usual decay split, and the learning-rate schedule (warmup, then decay to a floor).

Biases and norm weights (every parameter with fewer than 2 dims) get no weight decay; frozen
parameters are left out. The schedule is a pure function of the step, so resuming needs nothing
but the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.train.freeze import freeze as freeze  # re-exported: kiln.train.trainer imports it from here

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and biases/norms/other vectors (not decayed)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
          ) -> torch.optim.Optimizer:
    """torch AdamW, fused where the parameters' device supports it, else foreach."""
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params}
    fused = len(devices) == 1 and next(iter(devices)) in ("cuda", "cpu", "mps") and \
        all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params)
    kwargs = {"fused": True} if fused else {"foreach": True}
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) > 1:  # expert parallel: DTensor experts beside plain weights cannot share one multi-tensor kernel
        kwargs = {"foreach": False}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kwargs)


def lr_factor(step: int, total: int, warmup: int, schedule: str, floor: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, then decay to `floor`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use cosine, linear or constant")
    return floor + (1.0 - floor) * decay


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: Iterable[float], factor: float) -> float:
    lr = 0.0
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = lr = base * factor
    return lr
