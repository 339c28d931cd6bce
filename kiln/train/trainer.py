"""The Trainer: loop, backward, accumulation, clipping, optimizer step, eval, checkpoints, resume.

    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.tasks import SEQUENCE_CLASSIFICATION
    from kiln.train import Trainer
    import torch

    cfg = AutoConfig.for_model("bert", vocab_size=99, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=37, max_position_embeddings=64)
    cfg.set_labels(3)
    model = from_config(cfg, task=SEQUENCE_CLASSIFICATION, seed=0)
    data = [{"input_ids": torch.randint(1, 99, (12,)), "labels": torch.tensor(i % 3)} for i in range(64)]
    Trainer(model, data, steps=20, batch_size=8, lr=1e-3, out_dir="/tmp/kiln-doc-run",
            progress=False).fit()

`model` is a module or a factory `device -> module`; `optimizer` a factory `param_groups ->
optimizer` (default AdamW, no decay on biases/norms); `data` a `kiln.data.Loader` or a sequence
of examples (dicts of tensors, padded by `pad_collate`); `step` a function `(model, batch) ->
loss` or `(loss_sum, count)` (default: the task model's own loss from `labels`). Settings are
the fields of `TrainSection`, given as `args=` and/or keyword overrides; `parallel` a
`ParallelSection` (the [parallel] table) whose plans are applied in setup (kiln.parallel).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch
from pydantic import ValidationError
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from kiln.data.loader import Loader
from kiln.errors import ConfigError, KilnError, NonFiniteError
from kiln.hub.config import write_json_atomic
from kiln.models.common.fast import set_fast
from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.common.wrapped import unwrap
from kiln.parallel.checkpoint import load_full_optimizer
from kiln.parallel.config import ParallelSection
from kiln.parallel.sharded_load import init_adapters, read_shards
from kiln.parallel.world import World, barrier, gather_objects, init_world, pick_device
from kiln.train import checkpoint as ckpt
from kiln.train import fallback, lock, plans, preempt
from kiln.train.checks import check_train_args
from kiln.train.config import TrainSection
from kiln.train.engine import BatchSource, StepEngine
from kiln.train.fp8 import swap_fp8
from kiln.train.metrics import MetricsLog, ProgressBar
from kiln.train.optim import OptimizerFactory, adamw, freeze, lr_factor, param_groups, set_lr
from kiln.train.resume import check_resume, model_fingerprint, reseed
from kiln.train.steps import StepFn, default_evaluate, default_step

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: bf16 outside the FP8 matmuls


class Callback:
    """Hooks into the loop; override what you need. `record` is the metrics.jsonl line."""

    def on_setup(self, trainer: Trainer, step: int) -> None:
        """Before weights load and the optimizer exists (`step`: the resumed step, 0 when fresh); may reshape the model."""
    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        """The engine that takes this run's steps (kiln.train.engine): return `engine`, or one wrapping it."""
        return engine

    def before_update(self, trainer: Trainer) -> None:
        """Gradients hold the mean over every unit of the window (before clipping): a last change to them."""
    def state_dict(self, trainer: Trainer) -> dict[str, Any] | None:
        """Called on every rank at each save (may be collective); rank 0's result goes into the checkpoint."""
        return None

    def load_state_dict(self, trainer: Trainer, state: dict[str, Any]) -> None:
        """On resume, every rank gets what `state_dict` saved (after the Trainer's own state is restored)."""
    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After each step; keys added to `record` go into its metrics.jsonl line."""
    def on_eval(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...
    def on_save(self, trainer: Trainer, path: Path) -> None: ...
    def on_end(self, trainer: Trainer) -> None: ...


class TrainLoader(BatchSource, Protocol):
    """What the Trainer reads of its loader beyond an engine's view (kiln.data.Loader, kiln.data.stream.StreamLoader)."""

    def check_size(self) -> None: ...

    @property
    def batches_per_epoch(self) -> int: ...


@runtime_checkable
class _MayLeaveUnused(Protocol):
    """A model whose step may leave trainable parameters without a gradient (an image-text model's tower)."""
    touch_every_parameter: bool

    @property
    def may_leave_parameters_unused(self) -> bool: ...


_FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # no cuDNN (Trainer.autocast)

class Trainer:
    def __init__(self, model: nn.Module | Callable[[torch.device], nn.Module], data: TrainLoader | Sequence[dict], *,
                 optimizer: OptimizerFactory | None = None, step: StepFn | None = None,
                 eval_data: Sequence[dict] | None = None,
                 evaluate: Callable[[Trainer], dict[str, float]] | None = None,
                 callbacks: Sequence[Callback] = (), args: TrainSection | None = None,
                 resume: str | Path | None = None, run_config: dict | None = None,
                 objectives: Any = None, parallel: ParallelSection | None = None,
                 data_fingerprint: dict | None = None, **overrides: Any):
        try:
            self.args = TrainSection(**{**(args.model_dump() if args else {}), **overrides})
        except ValidationError as e:
            raise ConfigError("; ".join(f"train.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
        check_train_args(self.args)
        self._model_arg, self.data, self.eval_data = model, data, eval_data
        self.optimizer_factory = optimizer
        self.step_fn = step or default_step
        self.evaluate_fn = evaluate
        self.callbacks = list(callbacks)
        # Combines the losses of a step that returns {name: loss} (kiln.train.multiobjective); None: their sum.
        self.objectives = objectives
        self.resume = Path(resume) if resume is not None else None
        self.run_config = run_config or {"train": self.args.model_dump(mode="json")}
        self.data_fingerprint = data_fingerprint or {}
        self.parallel = parallel
        self.plan: Any = None  # kiln.parallel.Parallelized once the plans are applied
        self.out_dir = Path(self.args.out_dir)
        self.step, self.skipped, self.stopped_early = 0, 0, False
        self.best: dict[str, Any] | None = None   # {"value", "checkpoint", "step"}
        self.evals_since_best = 0
        self.last_checkpoint: Path | None = None
        self.stopped_by: str | None = None  # SIGTERM, SIGINT or max_time (kiln.train.preempt)
        self.last_eval: dict[str, float] = {}
        self._restarted: str | None = None
        self._made_dir: Path | None = None  # the outermost folder this run created for out_dir  # --resume of a run that saved no checkpoint yet: why it starts at 0

    # ---- setup ------------------------------------------------------------------------------
    def _setup(self) -> None:
        a = self.args
        self.device = pick_device(a.device, int(os.environ.get("LOCAL_RANK", "0")))
        # a Trainer built without a run config (no [parallel] table) joins with the default timeout
        self.world: World = init_world(self.device, *([self.parallel.collective_timeout] if self.parallel else []))
        self.engine: StepEngine = plans.step_engine(self.parallel)  # how a step's gradients come to be
        for cb in self.callbacks:  # e.g. [ff]: its local steps between the engine's backprop steps
            self.engine = cb.wrap_engine(self, self.engine)
        if self.parallel is not None:
            reshaping = [type(cb).__name__ for cb in self.callbacks if type(cb).on_setup is not Callback.on_setup]
            plans.check_plan(self.parallel, a.precision, reshaping, self.world.size)
        # tp ranks of one group hold slices of one replica: they read the same data (and draw the same dropout)
        self.data_rank, self.data_shards = plans.data_shard(self.parallel, self.world.rank, self.world.size)
        torch.manual_seed(a.seed)  # same initial weights on every rank
        model = self._model_arg(self.device) if callable(self._model_arg) and not isinstance(
            self._model_arg, nn.Module) else self._model_arg
        # a model built on meta (kiln.parallel.sharded_load): each rank reads its share once the plans are applied
        lazy = model if isinstance(model, PreTrainedModel) and model.deferred_read else None
        deferred = lazy.deferred_read if lazy is not None else None  # (kiln.models.load_plan.DeferredRead)
        self.model: nn.Module = model if deferred else model.to(self.device)
        if deferred:
            init_adapters(self.model, self.device, deferred.seed)
        if a.precision == "fp8":  # before any plan wraps the blocks: their Linears run FP8 matmuls
            swap_fp8(self.model, a.fp8_recipe)
        torch.manual_seed(a.seed + self.data_rank)  # dropout differs between replicas, as in one big batch
        if a.freeze:
            freeze(self.model, a.freeze)
        # A Loader, or anything with its protocol (kiln.data.stream.StreamLoader): used as given.
        self.loader: TrainLoader = cast(TrainLoader, self.data) if hasattr(self.data, "next_batch") else Loader(
            self.data, a.batch_size, seed=a.seed, rank=self.data_rank, world_size=self.data_shards,
            pad_id=getattr(getattr(model, "config", None), "pad_token_id", 0) or 0,
            group_by_length=a.group_by_length, window=a.grad_accum)
        self.loader.check_size()
        if a.steps is not None:
            self.total_steps = a.steps
        elif a.epochs is None:  # (TrainSection refuses neither)
            raise ConfigError("set train.steps or train.epochs")
        else:
            self.total_steps = max(1, math.ceil(a.epochs * self.loader.batches_per_epoch / a.grad_accum))
        start = self._find_resume()
        if self.world.main and not self.out_dir.exists():
            # a kill from here on leaves a directory that `--resume` restarts from step 0; an error removes it
            self._made_dir = next(p for p in (self.out_dir, *self.out_dir.parents) if p.parent.exists())
            self.out_dir.mkdir(parents=True)
        resumed = ckpt.read_trainer_state(start) if start is not None else None
        for cb in self.callbacks:  # e.g. layer growth: the model takes its resumed shape before anything reads it
            cb.on_setup(self, resumed["step"] if resumed else 0)
        set_fast(self.model, not a.exact)  # the model has its final modules: each fast/exact switch flips
        self.fingerprint = {"model": model_fingerprint(self.model), "data": self.data_fingerprint,
                            "precision": a.precision, "world_size": self.world.size}
        self.config_notes: list[str] = []
        self.reshard = None  # set when resuming on another world size (kiln.train.resume.Reshard)
        if start is not None and resumed is not None:  # changed settings that break exactness are refused with it
            self.reshard, self.config_notes = check_resume(start, resumed, self.fingerprint, self.run_config,
                                                           self.data_shards)
        whole = start is not None and not plans.is_sharded(start)
        if lazy is not None and deferred and (whole or self.parallel is None):  # weights needed before the plans
            read_shards(lazy, deferred.index, self.device)
        self._preloaded: tuple[dict, list] | None = None
        if whole and start is not None:  # whole weights: in before any plan shards them (another if this one fails)
            start, optim, rngs = fallback.read_whole(self, start)
            self._preloaded = (optim, rngs)
        if self.parallel is not None:  # the model's final shape is known: shard it before the optimizer sees it
            self.plan = plans.apply_plans(self.model, self.parallel, self.world.size, self.device)
        if lazy is not None and lazy.deferred_read and deferred:  # this rank's slices, straight from the files
            read_shards(lazy, deferred.index, self.device)
        self.sharded = plans.is_sharded_run(self.plan)
        groups = param_groups(self.model, a.weight_decay)
        self.optimizer = (self.optimizer_factory or (lambda g: adamw(g, a.lr, a.betas, a.eps)))(groups)
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups]
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = lr
        self.scaler = torch.amp.GradScaler(self.device.type) if a.precision == "fp16" else None
        self.metrics = MetricsLog(self.out_dir, enabled=self.world.main, report_to=a.report_to,
                                  config=self.run_config, project=a.project)
        if self._restarted and self.world.main:  # the lost attempt's partial metrics are replaced
            print(f"resume: {self.out_dir} {self._restarted}; starting from step 0")
            self.metrics.clear()
        if start is not None:
            self._restore(start)
            if self.reshard is not None and self.world.main:
                print(f"resume: {self.reshard.line()}")
                self.metrics.log({"step": self.step, "note": self.reshard.line()})
            if self.config_notes and self.world.main:
                note = "resumed with changed settings: " + "; ".join(self.config_notes)
                print(f"resume: {note}")
                self.metrics.log({"step": self.step, "note": note})
        if isinstance(self.model, _MayLeaveUnused) and self.model.may_leave_parameters_unused:
            # a step that would leave trainable parameters without a gradient (an image-text model's tower on rows
            # without images) reaches them with a zero instead: DDP's and FSDP's reductions wait for every one, and
            # one process steps them as many processes do
            self.model.touch_every_parameter = True
        if self.world.active and (self.plan is None or self.plan.wrap_ddp):
            self.model = DistributedDataParallel(self.model, device_ids=[self.device.index]
                                                 if self.device.type == "cuda" else None)
        self.model.train()

    def _find_resume(self) -> Path | None:
        self.run_lock = lock.hold(self)  # before anything is written or read: one writer per run directory
        if self.resume is None:
            used = [p.name for p in (self.out_dir / "metrics.jsonl", *ckpt.list_paths(self.out_dir)) if p.exists()]
            if used:
                raise KilnError(f"{self.out_dir} already holds a run ({', '.join(used[:3])}); "
                                "continue it with --resume, or choose another train.out_dir")
            return None
        own = self.resume.resolve() == self.out_dir.resolve()
        notes: list[str] = []
        found = ckpt.latest_checkpoint(self.resume, notes.append)
        if self.world.main:
            for n in notes:
                print(f"resume: {n}")
        if found is None and notes and ckpt.list_paths(self.resume):  # checkpoints there, none usable: say why
            raise KilnError(f"{self.resume}: no checkpoint can be resumed from: "
                            + "; ".join(n.removesuffix("; using the previous checkpoint") for n in notes)
                            + ". Start a new run in another train.out_dir, or restore a checkpoint")
        if found is None and own:  # the same restart command works before and after the first save
            self._restarted = "holds no complete checkpoint yet"
            return None
        if found is None:
            raise KilnError(f"{self.resume}: no complete checkpoint to resume from")
        return found

    def _restore(self, path: Path) -> None:
        # the checkpoint's param groups carry the old hyperparameters; this run's config wins (lr is set per step)
        current: list[dict[str, object]] = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g}
                                         for g in self.optimizer.param_groups]
        optim, rngs = self._preloaded or (None, None)  # a plain checkpoint's, read before the plans
        if self.reshard is not None and self.sharded and not plans.is_sharded(path):
            # a plain checkpoint (DDP, or one process) into sharded parameters: each rank keeps its shards
            load_full_optimizer(self.model, self.optimizer, _preloaded(optim, path))
        elif self.sharded or plans.is_sharded(path):  # the weights too: each rank reads its own shards
            # resharded, a DCP checkpoint loads into whatever layout this run has (plain on one process too)
            path = fallback.load_sharded(self, path,
                                         self.sharded or (self.reshard is not None and plans.is_sharded(path)))
            rngs = ckpt.read_rng_states(path)
        else:
            try:
                self.optimizer.load_state_dict(_preloaded(optim, path))
            except ValueError as e:  # torch's words for param groups of other sizes
                raise KilnError(f"cannot resume from {path}: its optimizer state does not fit this run's trainable "
                                f"parameters ({e}); did train.freeze, [lora] or the optimizer change?") from None
        self._preloaded = None
        state = ckpt.read_trainer_state(path)
        for group, values in zip(self.optimizer.param_groups, current):
            group.update(values)
        self.step, self.skipped = state["step"], state["skipped"]
        if state.get("objectives") and self.objectives is not None:
            self.objectives.load_state_dict(state["objectives"])
        self.best, self.evals_since_best = state["best"], state["evals_since_best"]
        self.loader.load_state_dict(state["data"])
        for cb in self.callbacks:
            if type(cb).__name__ in state.get("callbacks", {}):
                cb.load_state_dict(self, state["callbacks"][type(cb).__name__])
        if state.get("engine") is not None:
            self.engine.load_state_dict(self, state["engine"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.reshard is None:
            ckpt.set_rng_state(_preloaded(rngs, path)[self.world.rank])
        else:
            reseed(self.args.seed, self.step, self.data_rank)
        self.last_checkpoint = path
        if self.world.main:
            self.metrics.truncate_after(self.step)
            print(f"resume: from {path.name} (step {self.step})")

    # ---- the loop ---------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward runs in: autocast to the run's precision; on CUDA's fast path, attention
        without cuDNN's kernels (on an H100 with torch 2.11, building cuDNN's attention plans took ~78% of a
        small LoRA step's CPU time; flash / memory-efficient attention agree within fp32 rounding)."""
        stack = contextlib.ExitStack()
        if self.args.precision != "fp32":
            stack.enter_context(torch.autocast(self.device.type, dtype=_DTYPES[self.args.precision]))
        if self.device.type == "cuda" and not self.args.exact:
            stack.enter_context(sdpa_kernel(_FAST_SDPA))
        return stack

    def fit(self) -> Trainer:
        """Train to `steps` (or `epochs`), evaluating and saving on schedule; returns self, its model back on
        the exact path (training ran the fast one unless `train.exact`)."""
        try:
            self._setup()
        except BaseException:
            lock.release(self, undo=True)  # a refused setup leaves the lock file as it was, and free
            self._remove_empty_dir()
            raise
        a = self.args
        bar = ProgressBar(self.total_steps, self.step, a.progress and self.world.main)
        stop = preempt.Stop(self).install()  # SIGTERM / SIGINT caught while the loop runs
        try:
            while self.step < self.total_steps and not self.stopped_early:
                before = self.step
                record = self._train_step()
                for cb in self.callbacks:  # before the log line is written: callbacks may add to the record
                    cb.on_step(self, record)
                def due(every: int) -> bool:  # a multiple of `every` reached since the last step
                    return bool(every) and self.step // every > before // every  # noqa: B023 - used in this iteration

                if due(a.log_every) or self.step == self.total_steps:
                    self.metrics.log(record)
                bar.update(self.step, "  ".join(f"{k} {record[k]:.4g}" for k in ("loss", "ff_loss", "lr") if k in record))
                ckpt.fault_point("step", self.step)
                last = self.step == self.total_steps
                improved = False
                if self._has_eval() and (due(a.eval_every) or last):
                    improved = self._evaluate()
                at_end = (last or self.stopped_early) and a.save_at_end
                if due(a.save_every) or at_end or improved:
                    self.save()
                if stop.requested():  # a signal or max_time, agreed on every rank: saved, said, stop here
                    break
        except BaseException:
            lock.release(self, undo=True)  # a failed run leaves the lock file as it found it
            self._remove_empty_dir()
            raise
        finally:
            stop.uninstall()
            lock.release(self)
            bar.close()
            self.metrics.close()
        self.optimizer.zero_grad(set_to_none=True)  # an engine that keeps zeroed gradients leaves none behind
        set_fast(self.model, False)  # the trained model goes back on its bit-exact path (as loaded models start)
        for cb in self.callbacks:
            cb.on_end(self)
        return self

    def _remove_empty_dir(self) -> None:
        """A run that failed before writing anything leaves no trace (bad input loses and changes nothing)."""
        if self._made_dir is None:
            return
        for d in (self.out_dir, *self.out_dir.parents):  # up to the first folder this run created
            if not d.is_dir() or any(d.iterdir()):
                return
            d.rmdir()
            if d == self._made_dir:
                return

    # One step: the engine brings the gradients (kiln.train.engine); the rest happens here, for every mode.
    def next_batch(self) -> dict[str, torch.Tensor]:
        """The loader's next batch, on this run's device."""
        return {k: v.to(self.device, non_blocking=True) for k, v in self.loader.next_batch().items()}

    def _train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        lr = set_lr(self.optimizer, self.base_lrs, lr_factor(self.step, self.total_steps, self.args.warmup_steps,
                                                             self.args.schedule, self.args.min_lr_ratio))
        out = self.engine.gradients(self)
        grad_norm = out.grad_norm
        if out.update:
            for cb in self.callbacks:
                cb.before_update(self)
            grad_norm = self.update(out.loss)
        self.step += out.steps
        dt = time.perf_counter() - t0
        pad = getattr(self.loader, "take_pad_fraction", lambda: None)()  # this rank's padded share of its slots
        return {"step": self.step, "loss": out.loss, "lr": lr if out.lr is None else out.lr, "grad_norm": grad_norm,
                "epoch": self.loader.epoch, "samples_per_s": out.samples / dt, "tokens": out.tokens,
                "tokens_per_s": out.tokens / dt, **({"pad_fraction": pad} if pad is not None else {}),
                "skipped": self.skipped, **out.extra}

    def update(self, loss: float) -> float:
        """Clip to train.clip_grad_norm, then the optimizer step unless the guard finds the loss or the gradient
        non-finite; gradients are cleared. Returns the norm before clipping. The one optimizer update of kiln:
        the Trainer's step calls it, and so do engines that take local steps (a cadence round)."""
        grad_norm = self.engine.clip(self, self.args.clip_grad_norm or float("inf"))
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite or (self.scaler is not None and math.isfinite(loss)):
            # fp16 overflow with a finite loss is the scaler's business: it skips and lowers the scale.
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        else:
            self._non_finite(loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=not self.engine.keep_grads)
        return grad_norm

    def _non_finite(self, loss: float, grad_norm: float) -> None:
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
        if self.args.non_finite == "fail":
            last = self.last_checkpoint.name if self.last_checkpoint else "none saved yet"
            raise NonFiniteError(f"non-finite {what} at step {self.step + 1}; stopping (train.non_finite = 'fail'). "
                                 f"Last good checkpoint: {last}")
        self.skipped += 1
        if self.world.main:
            print(f"step {self.step + 1}: non-finite {what}; optimizer step skipped ({self.skipped} so far)")

    # ---- eval, best, early stopping ---------------------------------------------------------
    def _has_eval(self) -> bool:
        return self.eval_data is not None or self.evaluate_fn is not None

    def run_eval(self) -> dict[str, float]:
        if self.evaluate_fn is not None:
            return self.evaluate_fn(self)
        if self.eval_data is None:
            raise KilnError("no eval data: give eval_data or an evaluate function to run an eval")
        eval_loader = Loader(self.eval_data, self.args.batch_size, rank=self.world.rank, world_size=1,
                             shuffle=False, collate=_collate(self.loader)) if not isinstance(self.eval_data, Loader) \
            else self.eval_data
        # Every rank evaluates its share; default_evaluate sums the counts over ranks.
        eval_loader.rank, eval_loader.world_size = self.data_rank, self.data_shards
        batches = itertools.islice(eval_loader, self.args.eval_batches)  # train.eval_batches caps it (None: all)
        return default_evaluate(self.model, batches, self.device, self.world, self.autocast)

    def _evaluate(self) -> bool:
        metrics = self.run_eval()
        self.last_eval = metrics
        self.metrics.log({"step": self.step, **metrics})
        for cb in self.callbacks:
            cb.on_eval(self, metrics)
        name, mode = self.args.best_metric, self.args.best_mode
        if not name:  # unset: the best checkpoint is kept by validation loss whenever evaluation runs (best.json)
            if "eval_loss" not in metrics:
                return False
            name, mode = "eval_loss", "min"
        if name not in metrics:
            raise KilnError(f"train.best_metric {name!r} is not among the eval metrics: {', '.join(metrics)}")
        value = metrics[name]
        better = self.best is None or (value > self.best["value"] if mode == "max" else value < self.best["value"])
        if better:
            self.best = {"value": value, "step": self.step, "checkpoint": ckpt.ckpt_name(self.step), "metric": name}
            self.evals_since_best = 0
            return True
        self.evals_since_best += 1
        if self.args.early_stopping_patience and self.evals_since_best >= self.args.early_stopping_patience:
            self.stopped_early = True
            if self.world.main:
                print(f"early stopping at step {self.step}: no better {name} in {self.evals_since_best} evals")
        return False

    # ---- checkpoints ------------------------------------------------------------------------
    def unwrapped(self) -> nn.Module:
        return unwrap(self.model)

    def save(self) -> Path:
        """Checkpoint now (rank 0 writes; every rank contributes its RNG state and waits)."""
        rngs = gather_objects(ckpt.rng_state(), self.world)
        extra = {type(cb).__name__: s for cb in self.callbacks if (s := cb.state_dict(self)) is not None}
        engine_state = self.engine.state_dict(self)
        path = self.out_dir / ckpt.ckpt_name(self.step)
        state: dict[str, Any] | None = None
        if self.world.main:
            self.metrics.sync()
            state = {"step": self.step, "skipped": self.skipped, "best": self.best,
                     "evals_since_best": self.evals_since_best, "data": self.loader.state_dict(),
                     "epoch": self.loader.epoch, "fingerprint": self.fingerprint, "run_config": self.run_config,
                     "scaler": self.scaler.state_dict() if self.scaler else None, "eval": self.last_eval,
                     "objectives": self.objectives.state_dict() if self.objectives is not None else None,
                     **({"callbacks": extra} if extra else {}), "engine": engine_state}
        if self.sharded:  # every rank writes its own shards
            path = plans.save_sharded_checkpoint(self.out_dir, self.step, self.model, self.optimizer, state, rngs)
        if state is not None:  # (rank 0: self.world.main)
            if not self.sharded:
                path = ckpt.save_checkpoint(self.out_dir, self.step, self.unwrapped(), self.optimizer, state, rngs)
            # Where the run stands, readable without opening a checkpoint (the data cursor included).
            write_json_atomic(self.out_dir / "run_state.json", {"step": self.step, "checkpoint": path.name,
                                                                 "epoch": self.loader.epoch, "data": state["data"]})
            keep = {self.best["checkpoint"]} if self.best else set()
            ckpt.prune_checkpoints(self.out_dir, self.args.keep_last, keep)
            if self.best:
                ckpt.write_best(self.out_dir, self.best["checkpoint"], self.best.get("metric", self.args.best_metric),
                                self.best["value"])
        barrier(self.world)
        self.last_checkpoint = path
        for cb in self.callbacks:
            cb.on_save(self, path)
        return path


T = TypeVar("T")


def _preloaded(value: T | None, path: Path) -> T:
    """A state `_restore` reads whenever it takes that branch (a plain checkpoint's optimizer state, read with its
    weights before the plans; the RNG states)."""
    if value is None:
        raise KilnError(f"cannot resume from {path}: its optimizer or RNG state was not read with its weights")
    return value


def _collate(loader: TrainLoader) -> Callable[[Sequence[dict]], dict]:
    """The train loader's collate, which eval batches use too."""
    collate = getattr(loader, "collate", None)
    if collate is None:
        raise KilnError(f"eval_data is batched with the train loader's collate, and a {type(loader).__name__} has "
                        "none: give eval_data as a kiln.data.Loader")
    return collate
