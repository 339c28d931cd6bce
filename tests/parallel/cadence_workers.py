"""Spawned ranks for the cadence tests: a small MLP regression, one rank slowed by a sleep per batch."""

from __future__ import annotations

import json
import os
import time

import torch
from torch import nn

from kiln.parallel.cadence import CadencePlanner, train_adaptive

DIM, BATCH = 16, 32


def data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random teacher network's outputs plus noise: learnable, not trivially linear."""
    teacher = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(DIM, 32, generator=teacher), torch.randn(32, 1, generator=teacher) / 4
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 1, generator=torch.Generator().manual_seed(seed + 1))
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def run(rank: int, world: int, out: str, name: str, planner_keys: dict, average: str, total_batches: int,
        slow_rank: int, delay: float) -> None:
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    x, y = data(seed=10 + rank, n=8192)  # each rank its own stream of training rows
    g = torch.Generator().manual_seed(rank)
    drawn = [0]  # batches this rank really drew, counted here rather than trusted from the stats

    def next_batch():
        drawn[0] += 1
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=g)
        return x[idx], y[idx]

    def loss_fn(net, batch):
        if rank == slow_rank:
            time.sleep(delay)  # the artificially slow device
        xb, yb = batch
        return nn.functional.mse_loss(net(xb), yb)

    hx, hy = data(seed=999, n=2048)  # held out
    with torch.no_grad():
        initial = float(nn.functional.mse_loss(net(hx), hy))
    planner = CadencePlanner(world=world, **planner_keys)
    stats = train_adaptive(net, opt, next_batch, loss_fn, total_batches, planner, average=average)
    with torch.no_grad():
        held_out = float(nn.functional.mse_loss(net(hx), hy))
        digest = float(sum(p.double().sum() for p in net.parameters()))
    result = {"wall": stats.wall_seconds, "rounds": stats.rounds, "batches": stats.batches,
              "plans": stats.plans, "anchors": stats.anchors, "drawn": drawn[0], "sync_share": stats.sync_share,
              "held_out": held_out, "initial": initial, "digest": digest,
              "weights": [p.detach().flatten().tolist() for p in net.parameters()]}
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_many(rank: int, world: int, out: str, jobs: list) -> None:
    for job in jobs:
        run(rank, world, out, *job)
