"""Spawned ranks for the cadence tests: a small MLP regression, one rank slowed by a sleep per batch, trained by
the Trainer under [parallel.cadence] (the engine `kiln train` ships)."""

from __future__ import annotations

import json
import os
import time

import torch
from torch import nn

from kiln.train import Callback, Trainer
from kiln.train.config import CadenceSection, ParallelSection

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


class Stream:
    """Each rank its own stream of random rows (the Trainer's data protocol); counts what it really drew."""
    epoch = 0

    def __init__(self, rank: int):
        self.x, self.y = data(seed=10 + rank, n=8192)  # each rank its own stream of training rows
        self.g = torch.Generator().manual_seed(rank)
        self.drawn = 0

    def next_batch(self) -> dict:
        self.drawn += 1
        idx = torch.randint(0, self.x.shape[0], (BATCH,), generator=self.g)
        return {"x": self.x[idx], "y": self.y[idx]}

    def check_size(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("these runs do not resume")


class Rounds(Callback):
    """Every round's record, on every rank (only rank 0 writes metrics.jsonl)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_step(self, trainer: Trainer, record: dict) -> None:
        self.records.append(record)


def run(rank: int, world: int, out: str, name: str, planner_keys: dict, average: str, total_batches: int,
        slow_rank: int, delay: float) -> None:
    """The adaptive cadence as `kiln train` runs it: the Trainer with [parallel.cadence], Adam, no clipping."""
    net = model()
    stream, rounds = Stream(rank), Rounds()

    def step(net: nn.Module, batch: dict) -> torch.Tensor:
        if rank == slow_rank:
            time.sleep(delay)  # the artificially slow device
        return nn.functional.mse_loss(net(batch["x"]), batch["y"])

    hx, hy = data(seed=999, n=2048)  # held out
    with torch.no_grad():
        initial = float(nn.functional.mse_loss(net(hx), hy))
    parallel = ParallelSection(cadence=CadenceSection(average=average, **planner_keys))
    trainer = Trainer(net, stream, step=step, optimizer=lambda groups: torch.optim.Adam(groups, lr=3e-3),
                      parallel=parallel, callbacks=[rounds], steps=total_batches // world, batch_size=BATCH,
                      lr=3e-3, weight_decay=0.0, schedule="constant", clip_grad_norm=None, device="cpu",
                      save_at_end=False, progress=False, out_dir=os.path.join(out, f"{name}-run{rank}"))
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    with torch.no_grad():
        held_out = float(nn.functional.mse_loss(net(hx), hy))
        digest = float(sum(p.double().sum() for p in net.parameters()))
    plans = [r["batches"] for r in rounds.records]
    result = {"wall": wall, "rounds": len(plans), "batches": [sum(col) for col in zip(*plans)],
              "plans": plans, "anchors": [r["anchor"] for r in rounds.records], "drawn": stream.drawn,
              "sync_share": sum(r["sync_share"] for r in rounds.records) / len(plans),
              "held_out": held_out, "initial": initial, "digest": digest,
              "weights": [p.detach().flatten().tolist() for p in net.parameters()]}
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_many(rank: int, world: int, out: str, jobs: list) -> None:
    for job in jobs:
        run(rank, world, out, *job)
