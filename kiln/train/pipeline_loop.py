"""Pipeline parallelism (kiln.parallel.pipeline) as a step engine: `[parallel] pp > 1` under `kiln train`.

Every pp rank of a dp group draws the same grad_accum batches; each batch runs through the schedule
in `parallel.microbatches` micro-batches, gradients accumulating as loss SUMS; one all-reduce then
gives every rank the window's loss sum (from the last stages) and target count (from the first
stages) over all dp groups, gradients are summed over dp (FSDP reduce-scatters them) and divided by
that count. Clipping takes the norm over all stages; the Trainer's update and record follow.
Evaluation calls the model as ever: its forward runs the stages one after another.
"""

from __future__ import annotations

import torch

from kiln.data.loader import batch_tokens
from kiln.parallel.pipeline import Pipeline, check_microbatches
from kiln.parallel.world import all_reduce_sum
from kiln.train.engine import StepContext, StepEngine, StepOutcome, Window


class PipelineEngine(StepEngine):
    """Takes every training step through the pipeline schedule (see the module docstring)."""

    def __init__(self) -> None:
        self.checked = False

    def gradients(self, run: StepContext) -> StepOutcome:
        pipe = _pipeline(run)
        a = run.args
        if not self.checked:  # before any rank sends anything: every rank refuses alike
            check_microbatches(pipe.microbatches, a.batch_size)
            self.checked = True
        window = Window.on(run.device)
        for _ in range(a.grad_accum):
            batch = run.next_batch()
            window.tokens += batch_tokens(batch, run.loader)
            with run.autocast():
                loss_sum, count = pipe.train_batch(batch)
            window.loss_sum += loss_sum.to(run.device)
            window.count += count.to(run.device)
        zero = torch.zeros((), dtype=torch.float64, device=run.device)
        # the loss lives on the last stages, and every stage counted the same targets: take them once per dp group
        totals = all_reduce_sum(torch.stack([window.loss_sum if pipe.has_last else zero,
                                             window.count if pipe.has_first else zero]), run.world)
        pipe.finish_gradients(float(totals[1]))
        return StepOutcome(float(totals[0] / totals[1]), window.tokens * run.data_shards,
                           a.batch_size * a.grad_accum * run.data_shards)

    def clip(self, run: StepContext, max_norm: float) -> float:
        return _pipeline(run).clip(max_norm)


def _pipeline(run: StepContext) -> Pipeline:
    """The run's pipeline schedule: this engine is chosen only for runs whose plan has one (pp > 1)."""
    pipe = run.plan.pipeline if run.plan is not None else None
    assert pipe is not None, "the pipeline engine runs under a pp plan"
    return pipe
