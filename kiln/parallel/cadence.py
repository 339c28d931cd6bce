"""Adaptive sync cadence: data parallelism for ranks of unequal speed (mixed GPUs, shared hosts).

Lockstep DDP makes every rank wait for the slowest at every step. Here each rank runs its own
number of batches between two syncs: the slowest rank runs `anchor` batches, a rank k times
faster about k * anchor (capped by `max_batch_diff` above the anchor and by `max_staleness`), so
all of them reach the sync at about the same moment. At a sync the ranks average either their
parameters (local SGD; each rank stepped its optimizer after every batch) or their summed
gradients (then one optimizer step), weighted by the batches each one ran.

The anchor tunes itself: with s the seconds one sync costs and c the slowest rank's seconds per
batch, sync takes s / (anchor * c + s) of the time, so the smallest anchor that keeps that share
under the target is ceil(s * (1 - target) / (target * c)). It never exceeds `max_staleness`.
`max_batch_diff = 0` is lockstep: one batch per rank, gradients averaged every step (DDP's math).

Works with any model and any backend (gloo on CPU included): a sync is one small all_gather of
timings (which is also where ranks wait for each other) and one flat all_reduce.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class CadencePlanner:
    """Pure bookkeeping: measured speeds in, batches per rank for the next round out (same on every rank)."""
    world: int
    anchor: int = 1
    target_sync_share: float = 0.1
    max_staleness: int = 16
    max_batch_diff: int = 8
    smoothing: float = 0.5          # weight of the newest measurement in the running averages
    batch_seconds: list[float] | None = None
    sync_seconds: float | None = None

    @property
    def lockstep(self) -> bool:
        return self.max_batch_diff == 0

    def observe(self, batch_seconds: list[float], sync_seconds: float) -> None:
        a = self.smoothing
        if self.batch_seconds is None:
            self.batch_seconds, self.sync_seconds = list(batch_seconds), sync_seconds
        else:
            self.batch_seconds = [a * new + (1 - a) * old for new, old in zip(batch_seconds, self.batch_seconds)]
            self.sync_seconds = a * sync_seconds + (1 - a) * self.sync_seconds

    def plan(self) -> list[int]:
        """Batches each rank runs before the next sync."""
        if self.lockstep:
            return [1] * self.world
        if self.batch_seconds is None:
            return [self.anchor] * self.world
        slowest = max(self.batch_seconds)
        t = self.target_sync_share
        need = self.sync_seconds * (1 - t) / (t * max(slowest, 1e-9))
        self.anchor = min(max(1, math.ceil(need)), self.max_staleness)
        cap = min(self.anchor + self.max_batch_diff, self.max_staleness)
        return [min(max(self.anchor, int(self.anchor * slowest / max(s, 1e-9))), cap) for s in self.batch_seconds]


def fit_to_budget(counts: list[int], remaining: int) -> list[int]:
    """Shrink a round's counts proportionally so they sum to exactly `remaining` batches when that is fewer.

    A rank may get 0 in this last round; it then joins the sync with weight 0.
    """
    total = sum(counts)
    if total <= remaining:
        return counts
    scaled = [c * remaining // total for c in counts]
    by_size = sorted(range(len(counts)), key=lambda j: -counts[j])
    for i in range(remaining - sum(scaled)):  # hand the rounding leftovers to the busiest ranks
        scaled[by_size[i % len(counts)]] += 1
    return scaled


@dataclass
class CadenceStats:
    rounds: int = 0
    batches: list[int] = field(default_factory=list)   # per rank, whole run
    plans: list[list[int]] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    sync_seconds: float = 0.0                          # time in the averaging all_reduce (this rank)
    wait_seconds: float = 0.0                          # time waiting for the others at the timing gather
    wall_seconds: float = 0.0

    @property
    def sync_share(self) -> float:
        return self.sync_seconds / self.wall_seconds if self.wall_seconds else 0.0


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def train_adaptive(model: nn.Module, optimizer: torch.optim.Optimizer, next_batch: Callable[[], Any],
                   loss_fn: Callable[[nn.Module, Any], torch.Tensor], total_batches: int, planner: CadencePlanner,
                   average: str = "params", group: Any = None) -> CadenceStats:
    """Run `total_batches` batches over all ranks (about: the last round is trimmed) with the adaptive cadence.

    `loss_fn(model, batch)` returns the batch's mean loss. Every rank starts from the same weights
    and ends with the same (averaged) weights. Returns this rank's statistics.
    """
    if average not in ("params", "grads"):
        raise ValueError(f"parallel.cadence.average must be 'params' or 'grads', got {average!r}")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    params = [p for p in model.parameters() if p.requires_grad]
    by_grads = average == "grads" or planner.lockstep
    stats = CadenceStats(batches=[0] * world)
    if by_grads:  # every parameter takes part in the flat all_reduce, used in a batch or not
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    done, last_sync = 0, 0.0
    start = time.perf_counter()
    while done < total_batches:
        counts = fit_to_budget(planner.plan(), total_batches - done)
        stats.plans.append(counts)
        stats.anchors.append(planner.anchor)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        for _ in range(counts[rank]):
            loss = loss_fn(model, next_batch())
            loss.backward()
            if not by_grads:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
        per_batch = (time.perf_counter() - t0) / max(counts[rank], 1)
        # The timing gather is also where fast ranks wait for slow ones. It carries the previous
        # sync's cost too, so every rank feeds the planner the same numbers and plans the same round.
        t1 = time.perf_counter()
        timing = torch.tensor([per_batch, last_sync], dtype=torch.float64)
        gathered = [torch.zeros_like(timing) for _ in range(world)]
        if world > 1:
            dist.all_gather(gathered, timing, group=group)
        else:
            gathered = [timing]
        planner.observe([float(g[0]) for g in gathered], max(float(g[1]) for g in gathered))
        t2 = time.perf_counter()
        weight = counts[rank] / sum(counts)
        if by_grads:  # sum of per-batch gradients over all batches / number of batches = the mean gradient
            grads = [p.grad for p in params]
            flat = _flat(grads) / sum(counts)
        else:
            flat = _flat(params) * weight
        if world > 1:
            dist.all_reduce(flat, group=group)
        with torch.no_grad():
            _unflat(flat, grads if by_grads else params)
        t3 = time.perf_counter()
        last_sync = t3 - t2
        if by_grads:
            optimizer.step()
        stats.wait_seconds += t2 - t1
        stats.sync_seconds += t3 - t2
        stats.rounds += 1
        for r, c in enumerate(counts):
            stats.batches[r] += c
        done += sum(counts)
    optimizer.zero_grad(set_to_none=True)
    stats.wall_seconds = time.perf_counter() - start
    return stats
