"""The adaptive cadence (kiln.parallel.cadence) as a step engine: `[parallel.cadence]` under `kiln train`.

One engine step here is one round: every rank runs the number of batches the planner gave it,
then all ranks sync. The run's budget is what lockstep data parallelism would spend, `train.steps`
x world batches; after a round the step counter reads batches done // world, so schedules,
save_every and eval_every keep their lockstep meaning (a round may cross several steps).

At a sync, `average = "params"` (each rank stepped its optimizer after every batch) averages the
parameters and the optimizer's state; `"grads"` averages the summed gradients and takes one
optimizer step (the Trainer's, as every other mode's). Local steps go through `Trainer.update`, so
clipping and the non-finite guard are the Trainer's too. Both weight each rank by the loss units (tokens, rows) it processed, so every
rank leaves a sync identical: a checkpoint (always taken at a sync) holds the whole run, plus
the planner's measurements and every rank's data cursor, and resumes exactly.

Testing hook: KILN_SLOW_RANK="rank:seconds" makes that rank sleep after each of its batches.
"""

from __future__ import annotations

import os
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from kiln.data.loader import batch_tokens
from kiln.errors import ConfigError, KilnError
from kiln.parallel.cadence import CadencePlanner, fit_to_budget, flat, unflat
from kiln.parallel.config import CadenceSection
from kiln.train.engine import StepContext, StepEngine, StepOutcome
from kiln.train.steps import as_sum_and_count


def _slow_seconds(rank: int) -> float:
    spec = os.environ.get("KILN_SLOW_RANK", "")
    if not spec:
        return 0.0
    who, seconds = spec.split(":")
    return float(seconds) if int(who) == rank else 0.0


class CadenceEngine(StepEngine):
    """Takes every step of the run as one cadence round (see the module docstring)."""
    keep_grads = True  # every parameter takes part in the flat all_reduce and in the optimizer's state

    def __init__(self, section: CadenceSection):
        self.section = section
        self.planner: CadencePlanner | None = None
        self.done = 0            # batches run over all ranks so far
        self.rounds = 0
        self.last_sync = 0.0     # seconds the previous sync took (max over ranks)
        self.restored: dict[str, Any] | None = None

    # ---- setup and checkpoint state ----------------------------------------------------------
    def _start(self, run: StepContext) -> None:
        a, s = run.args, self.section
        if a.grad_accum != 1:
            raise ConfigError(f"parallel.cadence decides how many batches each rank runs between syncs; "
                              f"train.grad_accum must be 1, got {a.grad_accum}")
        if a.precision == "fp16":
            raise ConfigError("parallel.cadence with train.precision = 'fp16' is not supported (the loss scaler "
                              "would differ between ranks); use 'bf16'")
        if run.plan is not None and run.plan.degrees.batch != run.world.size:
            raise ConfigError("parallel.cadence is data parallel only: parallel.tp and parallel.ep must be 1")
        self.world, self.rank = run.world.size, run.world.rank
        self.budget = run.total_steps * self.world
        self.planner = CadencePlanner(self.world, anchor=s.anchor, target_sync_share=s.target_sync_share,
                                      max_staleness=s.max_staleness, max_batch_diff=s.max_batch_diff)
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        # every parameter takes part in the flat all_reduce and gets optimizer state at the first
        # step, used by this rank's batches or not (an MoE expert may be idle on one rank only)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.slow = _slow_seconds(self.rank)
        self.done = run.step * self.world
        if self.restored is not None:
            r = self.restored
            if r["world"] != self.world:
                raise KilnError(f"this cadence checkpoint was written by {r['world']} processes; resume it with "
                                f"{r['world']} (each rank's data cursor is its own)")
            self.done, self.rounds, self.last_sync = r["done"], r["rounds"], r["last_sync"]
            self.planner.anchor = r["anchor"]
            self.planner.batch_seconds, self.planner.sync_seconds = r["batch_seconds"], r["sync_seconds"]
            run.loader.load_state_dict(r["data"][self.rank])

    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        """Collective: every rank's data cursor (the ranks ran different numbers of batches)."""
        cursors: list[dict[str, Any] | None] = [None] * run.world.size  # each rank's loader state
        if run.world.active:
            dist.all_gather_object(cursors, run.loader.state_dict())
        else:
            cursors = [run.loader.state_dict()]
        p = self.planner
        return {"world": run.world.size, "done": self.done, "rounds": self.rounds, "last_sync": self.last_sync,
                "anchor": p.anchor if p else self.section.anchor, "batch_seconds": p.batch_seconds if p else None,
                "sync_seconds": p.sync_seconds if p else None, "data": cursors}

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:
        self.restored = state

    # ---- one round -----------------------------------------------------------------------------
    def gradients(self, run: StepContext) -> StepOutcome:
        if self.planner is None:
            self._start(run)
        planner = self.planner
        assert planner is not None  # _start made it
        t_round = time.perf_counter()
        by_grads = self.section.average == "grads" or planner.lockstep
        counts = fit_to_budget(planner.plan(), self.budget - self.done)
        anchor = planner.anchor
        loss_sum, units, tokens, norms = 0.0, 0.0, 0, []
        run.optimizer.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        for _ in range(counts[self.rank]):
            batch = run.next_batch()
            tokens += batch_tokens(batch, run.loader)
            with run.autocast():
                result = run.step_fn(run.model, batch)
            if isinstance(result, dict):
                raise KilnError("parallel.cadence does not support a step returning several losses")
            part, n = as_sum_and_count(result, batch)
            (part if by_grads else part / n.to(part.device)).backward()
            loss_sum, units = loss_sum + float(part.detach()), units + float(n)
            if not by_grads:  # local SGD: this rank's own (clipped, guarded) step after each batch
                norms.append(run.update(float(part.detach()) / float(n)))
            if self.slow:
                time.sleep(self.slow)
        per_batch = (time.perf_counter() - t0) / max(counts[self.rank], 1)
        # One gather: speeds for the planner (also where fast ranks wait), the previous sync's cost, the sums.
        t1 = time.perf_counter()
        mine = torch.tensor([per_batch, self.last_sync, loss_sum, units, tokens], dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(rows, mine)
        else:
            rows = [mine]
        planner.observe([float(r[0]) for r in rows], max(float(r[1]) for r in rows))
        total_units = sum(float(r[3]) for r in rows)
        t2 = time.perf_counter()
        if by_grads:  # the gradient summed over every unit of the round / units = the mean gradient
            # every parameter has its .grad here: the round's backward passes ran with zero_grad(set_to_none=False)
            tensors = cast(list[torch.Tensor], [p.grad for p in self.params])
            flat_ = flat(tensors) / total_units
        else:  # parameters and optimizer state, each rank weighted by its share of the units
            tensors = [*self.params, *self._optimizer_tensors(run.optimizer)]
            flat_ = flat(tensors) * (units / total_units)
        if self.world > 1:
            dist.all_reduce(flat_)
        with torch.no_grad():
            unflat(flat_, tensors)
        t3 = time.perf_counter()
        self.last_sync = t3 - t2
        self.done += sum(counts)
        self.rounds += 1
        wall = time.perf_counter() - t_round
        return StepOutcome(
            loss=sum(float(r[2]) for r in rows) / max(total_units, 1.0),
            tokens=int(sum(float(r[4]) for r in rows)), samples=sum(counts) * run.args.batch_size,
            steps=max(1, self.done // self.world - run.step), update=by_grads,
            grad_norm=sum(norms) / len(norms) if norms else float("nan"),
            extra={"round": self.rounds, "batches": counts, "anchor": anchor, "sync_share": (t3 - t2) / wall,
                   "wait_share": (t2 - t1) / wall})

    @staticmethod
    def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's floating state (moments, step counts), in parameter order: averaged like the weights."""
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                out += [state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].is_floating_point()]
        return out
