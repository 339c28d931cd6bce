"""Pipeline parallelism (kiln.parallel.pipeline) inside the Trainer: `[parallel] pp > 1` under `kiln train`.

Each step is the Trainer's own, taken through the pipeline schedule: every pp rank of a dp group draws the
same grad_accum batches; each batch runs through the schedule in `parallel.microbatches` micro-batches,
gradients accumulating as loss SUMS; one all-reduce then gives every rank the window's loss sum (from
the last stages) and target count (from the first stages) over all dp groups, gradients are summed
over dp (FSDP reduce-scatters them) and divided by that count, the norm for clipping is taken over all
stages, and the Trainer's guarded update and metrics record follow. Evaluation calls the model as
ever: its forward runs the stages one after another (kiln.parallel.pipeline).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kiln.data.loader import batch_tokens
from kiln.parallel.pipeline import check_microbatches
from kiln.parallel.world import all_reduce_sum
from kiln.train.optim import lr_factor, set_lr
from kiln.train.trainer import Callback, _Window


class PipelineCallback(Callback):
    """Takes every training step through the pipeline schedule (see the module docstring)."""

    def __init__(self) -> None:
        self.checked = False

    def take_step(self, trainer: Any) -> dict[str, Any] | None:
        pipe = trainer.plan.pipeline
        a = trainer.args
        if not self.checked:  # before any rank sends anything: every rank refuses alike
            check_microbatches(pipe.microbatches, a.batch_size)
            self.checked = True
        t0 = time.perf_counter()
        window = _Window(trainer.device)
        for _ in range(a.grad_accum):
            batch = {k: v.to(trainer.device, non_blocking=True) for k, v in trainer.loader.next_batch().items()}
            window.tokens += batch_tokens(batch, trainer.loader)
            with trainer.autocast():
                loss_sum, count = pipe.train_batch(batch)
            window.loss_sum += loss_sum.to(trainer.device)
            window.count += count.to(trainer.device)
        zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
        # the loss lives on the last stages, and every stage counted the same targets: take them once per dp group
        totals = all_reduce_sum(torch.stack([window.loss_sum if pipe.has_last else zero,
                                             window.count if pipe.has_first else zero]), trainer.world)
        loss = float(totals[0] / totals[1])
        pipe.finish_gradients(float(totals[1]))
        for cb in trainer.callbacks:
            cb.before_update(trainer)
        grad_norm = pipe.clip(a.clip_grad_norm if a.clip_grad_norm else float("inf"))
        lr = set_lr(trainer.optimizer, trainer.base_lrs, lr_factor(trainer.step, trainer.total_steps,
                                                                   a.warmup_steps, a.schedule, a.min_lr_ratio))
        trainer._update(loss, grad_norm)
        record = trainer._record(window, loss, grad_norm, lr, time.perf_counter() - t0)
        record["step"] = trainer.step + 1  # the Trainer advances its counter to this
        return record
