"""What the sequence-scoring recipes (dpo, kto, reward-model) share, written once: their [data] with `pack`, and
the run's skeleton (`ScoredRun`): its trainer, per-step sums of named statistics reduced over every rank into the
step's record (with the real tokens and the samples that carried signal), and the evaluation loop over this
rank's share of the eval rows, in eval mode, reduced the same way. A recipe supplies its statistics' names, how
a micro-batch's sums are made (`eval_sums`), and optionally their means (`means`) and eval batches."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kiln.parallel.world import all_reduce_sum
from kiln.train.engine import StepEngine
from kiln.train.preference import Signal
from kiln.train.recipes.finetune import RecordsData
from kiln.train.shares import eval_share, record_tokens
from kiln.train.trainer import Callback, Trainer


class PackedData(RecordsData):
    """[data] of a recipe that scores whole sequences (preference pairs, unpaired rows)."""
    pack: bool = True  # a micro-batch's sequences packed into rows, attention kept per sequence
                       # (where the model cannot keep them apart, one per row: kiln.train.packing)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode for the block, then back in the mode it was in."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class ScoredRun(Callback, abc.ABC):
    """The skeleton of a dpo / kto / reward-model run. `STATS` names the sums a micro-batch adds (the first two:
    its samples and its real tokens; the third its summed loss), `signal` counts the samples that carried one."""
    STATS: tuple[str, ...] = ()

    def __init__(self, evals: list[dict[str, torch.Tensor]] | None, pack: bool, signal: Signal):
        self.evals, self.pack, self.signal = evals, pack, signal
        self.trainer: Trainer | None = None
        self.sums = torch.zeros(len(self.STATS), dtype=torch.float64)

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        self.trainer = trainer  # the run this callback serves (its plans, device, output folder)
        return engine

    def ready(self) -> None:
        """Once-per-run setup before the first step or evaluation (a reference placed, say); none by default."""

    def means(self, sums: torch.Tensor, prefix: str) -> dict[str, float]:
        """The metrics of summed statistics: by default each (after samples and tokens) per sample."""
        samples = float(sums[0]) or 1.0
        return {f"{prefix}{name}": float(v) / samples for name, v in zip(self.STATS[2:], sums[2:])}

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        sums = all_reduce_sum(self.sums.to(trainer.device, copy=True), trainer.world).cpu()
        self.sums.zero_()
        means = self.means(sums, "")
        means.pop("loss")  # the Trainer's own (the same mean)
        record.update(means)
        record_tokens(record, float(sums[0]), float(sums[1]))  # the step's real tokens, every rank's
        self.signal.log(record, trainer.world, trainer.device, trainer.step)

    def eval_batches(self, trainer: Trainer) -> Iterable[dict[str, torch.Tensor]]:
        """This rank's share of the eval rows in batches (a `weight` of 0 on rows that only even the ranks out)."""
        return eval_share(self.evals or [], trainer.data_rank, trainer.data_shards, trainer.args.batch_size,
                          trainer.device, trainer.args.eval_batches)

    @abc.abstractmethod
    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(len(STATS),) one eval batch's sums, each row weighted by batch["weight"]."""

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        self.ready()
        sums = torch.zeros(len(self.STATS), dtype=torch.float64)
        with evaluating(trainer.model):
            for batch in self.eval_batches(trainer):
                with trainer.autocast():
                    sums += self.eval_sums(trainer.model, batch)
        sums = all_reduce_sum(sums.to(trainer.device, copy=True), trainer.world).cpu()
        return self.means(sums, "eval_")
