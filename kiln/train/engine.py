"""How one training step's gradients come to be: the seam between the Trainer and the ways a step runs.

The Trainer does what every step shares, once: the learning-rate schedule, the `before_update`
callbacks, clipping, the non-finite guard, the optimizer update, the metrics record. A `StepEngine`
does the rest: it draws the step's batches, runs forward and backward under the right sync context,
reduces, and leaves in `.grad` the mean gradient over every unit (token, row) of the step, returning
a `StepOutcome`. Engines:

- `DataParallel` (here): `grad_accum` micro-batches; only the last one syncs (DDP, FSDP2); one
  all-reduce of the loss sums and unit counts; gradients scaled to the mean over every unit.
- `PipelineEngine` (kiln.train.pipeline_loop): the same window through the pipeline schedule.
- `CadenceEngine` (kiln.train.cadence_loop): one adaptive-cadence round, which may count as several
  steps; averaging parameters, it takes its local updates through `Trainer.update` (the one
  optimizer step of kiln) and hands back no gradient (`update=False`).
- `FFEngine` (kiln.train.recipes.ff): the Forward-Forward local step, wrapping another engine for
  the backprop steps.
"""

from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from kiln.data.loader import batch_tokens
from kiln.errors import KilnError
from kiln.parallel.grads import clip_grad_norm as dist_clip_grad_norm
from kiln.parallel.world import World, all_reduce_sum
from kiln.train.steps import StepFn, as_sum_and_count, sum_losses

if TYPE_CHECKING:
    from kiln.parallel.apply import Parallelized
    from kiln.parallel.config import ParallelSection
    from kiln.train.config import TrainSection


class BatchSource(Protocol):
    """What the Trainer reads data from: kiln.data.Loader, kiln.data.stream.StreamLoader or your own."""

    @property
    def epoch(self) -> int: ...  # (read only: a StreamLoader's is its cursor's)

    def next_batch(self) -> dict[str, torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Objectives(Protocol):
    """Combines the gradients of a step returning {name: loss} (kiln.train.multiobjective)."""

    def backward(self, losses: dict[str, torch.Tensor], params: list[nn.Parameter], step: int) -> torch.Tensor: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepContext(Protocol):
    """The Trainer as an engine sees it (kiln.train.trainer.Trainer)."""
    args: TrainSection
    device: torch.device
    world: World
    model: nn.Module
    step_fn: StepFn
    optimizer: torch.optim.Optimizer
    plan: Parallelized | None
    parallel: ParallelSection | None  # the [parallel] table
    scaler: torch.amp.GradScaler | None
    objectives: Objectives | None
    step: int
    total_steps: int
    data_rank: int
    data_shards: int
    sharded: bool

    @property
    def loader(self) -> BatchSource: ...  # (an engine reads batches through it; it never replaces it)

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...
    def update(self, loss: float) -> float: ...
    def next_batch(self) -> dict[str, torch.Tensor]: ...


@dataclass
class StepOutcome:
    """What one engine step did. `loss` is the mean over every unit of the step (all ranks)."""
    loss: float
    tokens: int                    # real tokens of the step over all data shards
    samples: int                   # rows of the step over all data shards
    steps: int = 1                 # how many Trainer steps it counts as (a cadence round may cross several)
    update: bool = True            # .grad holds the step's mean gradient: the Trainer clips and updates
    grad_norm: float = math.nan    # update=False: the norm of what the engine applied itself
    lr: float | None = None        # update=False: the rate the engine applied, when not the schedule's
    extra: dict[str, Any] = field(default_factory=dict)  # mode-specific fields of the metrics record


@dataclass
class Window:
    """What the micro-batches of one step add up to (float64 sums, on the device)."""
    loss_sum: torch.Tensor
    count: torch.Tensor
    tokens: int = 0
    objectives: dict[str, float] = field(default_factory=dict)

    @classmethod
    def on(cls, device: torch.device) -> Window:
        return cls(torch.zeros((), dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device))


class StepEngine(abc.ABC):
    """Base of the engines: how a step's gradients come to be (see the module docstring)."""
    keep_grads = False   # True: gradients are zeroed, not freed, after an update (flat all-reduces need them all)

    @abc.abstractmethod
    def gradients(self, run: StepContext) -> StepOutcome:
        """Draw the step's batches, run forward and backward, reduce: `.grad` holds the step's mean gradient."""

    def clip(self, run: StepContext, max_norm: float) -> float:
        """Clip the gradients to `max_norm` (DTensor-aware when sharded); their norm before clipping."""
        params = [p for p in run.model.parameters() if p.grad is not None]
        return float(dist_clip_grad_norm(params, max_norm) if run.sharded
                     else torch.nn.utils.clip_grad_norm_(params, max_norm))

    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        """Called on every rank at each save (may be collective); rank 0's result goes into the checkpoint."""
        return None

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """On resume, every rank gets what `state_dict` saved."""


def mean_gradients(run: StepContext, window: Window) -> float:
    """Sum the window over ranks and turn gradients into the mean over every unit; the mean loss."""
    # tp ranks add identical copies of their group's sums: loss_sum / count is unchanged by them; cp ranks
    # each add the sums over their own chunks of the rows (kiln.parallel.context), which make the rows' sums.
    totals = all_reduce_sum(torch.stack([window.loss_sum, window.count]), run.world)
    loss = float(totals[0] / totals[1])
    # Gradients now hold the mean over the data shards of each shard's summed-unit gradient; turn that
    # into the mean over every unit. totals[1] counts every unit tp times, and world = shards * tp. Under cp,
    # DDP / FSDP average over the dp x cp ranks, each unit is counted once, and world = dp * cp: the same scale.
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    scale = run.world.size / float(totals[1])
    if run.sharded:
        for g in grads:  # DTensor gradients: foreach ops would need one mesh for all of them
            g.mul_(scale)
    else:
        torch._foreach_mul_(grads, scale)
    return loss


def gradient_sync(run: StepContext, last: bool) -> contextlib.AbstractContextManager[Any]:
    """The context a micro-batch's forward and backward run under: only the window's `last` one reduces
    gradients (DDP, FSDP2), the others accumulate locally. The seam for every engine that runs its own
    micro-batch loop (DataParallel, GRPO's update)."""
    sync = last or not run.world.active
    if run.plan is not None and run.plan.fsdp:
        cast(FSDPModule, run.model).set_requires_gradient_sync(sync)  # the plan applied fully_shard to it
    if not sync and isinstance(run.model, DistributedDataParallel):
        return run.model.no_sync()
    return contextlib.nullcontext()


class DataParallel(StepEngine):
    """grad_accum micro-batches, forward and backward each, one reduction: plain, DDP, FSDP2, TP, EP, CP."""

    def gradients(self, run: StepContext) -> StepOutcome:
        window = Window.on(run.device)
        accum = run.args.grad_accum
        for micro in range(accum):
            self._micro_step(run, window, last=micro == accum - 1)
        if run.plan is not None:
            run.plan.sync_gradients()  # tp with dp > 1, and ep: neither DDP nor FSDP averages these
        loss = mean_gradients(run, window)
        return StepOutcome(loss, window.tokens * run.data_shards, run.args.batch_size * accum * run.data_shards,
                           extra={f"loss_{k}": v / accum for k, v in sorted(window.objectives.items())})

    def _micro_step(self, run: StepContext, window: Window, last: bool) -> None:
        """Forward and backward of one micro-batch, under the right sync context; sums into `window`."""
        batch = run.next_batch()
        window.tokens += batch_tokens(batch, run.loader)
        with gradient_sync(run, last), run.autocast():
            result = run.step_fn(run.model, batch)
        if isinstance(result, dict):  # several objectives: combine their gradients (one unit per micro-batch)
            part, n = self._backward_objectives(run, result, window), torch.ones((), dtype=torch.float64)
        else:
            part, n = as_sum_and_count(result, batch)
            (run.scaler.scale(part) if run.scaler else part).backward()
        window.loss_sum += part.detach().to(torch.float64)
        window.count += n.to(run.device)

    @staticmethod
    def _backward_objectives(run: StepContext, losses: dict[str, torch.Tensor], window: Window) -> torch.Tensor:
        if run.scaler is not None or run.world.active:
            raise KilnError("a step returning several losses supports neither fp16 nor several processes yet")
        for name, value in losses.items():
            window.objectives[name] = window.objectives.get(name, 0.0) + float(value.detach())
        if run.objectives is not None:
            return run.objectives.backward(losses, list(run.model.parameters()), run.step)
        total = sum_losses(losses)
        total.backward()
        return total.detach()
