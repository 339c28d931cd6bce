"""Adaptive sync cadence: data parallelism for ranks of unequal speed (mixed GPUs, shared hosts).

Lockstep DDP makes every rank wait for the slowest at every step. Here each rank runs its own
number of batches between two syncs: the slowest rank runs `anchor` batches, a rank k times
faster about k * anchor (capped by `max_batch_diff` above the anchor and by `max_staleness`), so
all of them reach the sync at about the same moment. At a sync the ranks average either their
parameters (local SGD; each rank stepped its optimizer after every batch) or their summed
gradients (then one optimizer step), weighted by the loss units (tokens, rows) each one ran.

The anchor tunes itself: with s the seconds one sync costs and c the slowest rank's seconds per
batch, sync takes s / (anchor * c + s) of the time, so the smallest anchor that keeps that share
under the target is ceil(s * (1 - target) / (target * c)). It never exceeds `max_staleness`.
`max_batch_diff = 0` is lockstep: one batch per rank, gradients averaged every step (DDP's math).

Works with any model and any backend (gloo on CPU included): a sync is one small all_gather of
timings (which is also where ranks wait for each other) and one flat all_reduce. The round itself
runs in the Trainer, as its step engine (kiln.train.cadence_loop); this module is the planning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
            self.sync_seconds = a * sync_seconds + (1 - a) * self._sync_seconds()

    def _sync_seconds(self) -> float:
        """The running sync time, measured with the batch times (they are set together)."""
        if self.sync_seconds is None:
            raise ValueError("CadencePlanner: batch_seconds without sync_seconds; give both or neither")
        return self.sync_seconds

    def plan(self) -> list[int]:
        """Batches each rank runs before the next sync."""
        if self.lockstep:
            return [1] * self.world
        if self.batch_seconds is None:
            return [self.anchor] * self.world
        slowest = max(self.batch_seconds)
        t = self.target_sync_share
        need = self._sync_seconds() * (1 - t) / (t * max(slowest, 1e-9))
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


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of `tensors` (for one all_reduce)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat` back into `tensors`, in order."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
