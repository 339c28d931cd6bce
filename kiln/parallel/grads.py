"""Gradient averaging and clipping for models whose parameters mix plain tensors and DTensors.

DDP and FSDP2 reduce gradients themselves; expert parallelism does not fit either (experts are
sharded over ep and replicated over dp, everything else is replicated over dp * ep), so
`average_gradients` does it by hand: one flat all-reduce per group. `clip_grad_norm` works for any
mix of plain and DTensor gradients (torch's stacks per-tensor norms, which mixed meshes refuse).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _all_reduce_flat(grads: list[torch.Tensor], group, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def average_gradients(params: Iterable[torch.nn.Parameter], batch_group, ranks: int, sharded_group=None) -> None:
    """Turn per-rank gradients of per-rank mean losses into the gradient of their mean over `ranks` ranks.

    Plain gradients are summed over `batch_group` (every rank that read different data). DTensor
    gradients (EP-sharded experts) already hold the sum over their ep group, so they are summed
    over `sharded_group` (the dp replicas of the shard) only. Both are then divided by `ranks`.
    """
    plain: list[torch.Tensor] = []
    sharded: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        (sharded if isinstance(p.grad, DTensor) else plain).append(p.grad.to_local() if isinstance(p.grad, DTensor)
                                                                    else p.grad)
    _all_reduce_flat(plain, batch_group, 1.0 / ranks)
    _all_reduce_flat(sharded, sharded_group, 1.0 / ranks)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):  # a partial norm over a shard: full_tensor() reduces it over the mesh
            n = n.full_tensor()
        total += n.double().cpu() ** 2
    return scale_to_norm(grads, math.sqrt(float(total)), max_norm)


@torch.no_grad()
def scale_to_norm(grads: list[torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale `grads`, whose global 2-norm is `norm`, down to `max_norm` (a non-finite norm: left alone); the norm."""
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
