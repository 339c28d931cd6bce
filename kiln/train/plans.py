"""The Trainer's side of the [parallel] table: which rank reads which data, applying the plans, sharded saves.

`kiln.parallel` holds the plans themselves (FSDP2, tensor and expert parallel, activation checkpointing,
compile); this module is the little the Trainer needs around them:

- data shards come from the mesh: dp x ep ranks read different batches, the tp ranks of one group
  read the same one (they hold slices of one model replica);
- runs whose weights are DTensors (fsdp, tp or ep on several processes) save sharded DCP
  checkpoints, sealed like every other checkpoint: written to `.ckpt-N.tmp`, a manifest of
  checksums last, then renamed, so resume skips a half-written one by name;
- combinations the Trainer cannot run are refused here, naming the keys;
- which step engine takes the steps: the pipeline schedule, cadence rounds, or plain data parallel.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.models.common.fast import set_fast
from kiln.models.common.pretrained import PreTrainedModel
from kiln.parallel.apply import Parallelized, parallelize
from kiln.parallel.checkpoint import is_sharded, load_sharded, save_sharded
from kiln.parallel.config import ParallelSection
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import DIMS, holds_shards, resolve_degrees
from kiln.parallel.sharded_load import read_shards
from kiln.train import checkpoint as ckpt
from kiln.train.cadence_loop import CadenceEngine
from kiln.train.engine import DataParallel, StepEngine
from kiln.train.pipeline_loop import PipelineEngine


def data_shard(parallel: ParallelSection | None, rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's data shard, number of shards): tp, cp and pp ranks of one group read the same rows."""
    if parallel is None:
        return rank, world_size
    degrees = resolve_degrees(parallel, world_size)
    return degrees.data_shard(rank), degrees.batch


def check_plan(parallel: ParallelSection, precision: str, reshaping: list[str], world_size: int) -> None:
    """Refuse what the Trainer cannot run with these plans (before any model work); `reshaping` names the
    callbacks that may change the model's shape in `on_setup` (layer growth)."""
    sharded = holds_shards(parallel, world_size)
    if sharded and precision == "fp16":
        raise ConfigError("train.precision = 'fp16' with parallel.fsdp / tp / ep / pp is not supported (the loss "
                          "scaler does not handle sharded gradients); use 'bf16'")
    if reshaping and (sharded or parallel.compile or parallel.activation_checkpointing != "none"):
        raise ConfigError(f"{', '.join(reshaping)} reshapes the model during the run, which the [parallel] plans "
                          f"(fsdp, tp, ep, activation_checkpointing, compile) cannot follow; remove [grow] or them")


def step_engine(parallel: ParallelSection | None) -> StepEngine:
    """How the Trainer's steps get their gradients: the pipeline schedule (pp > 1), cadence rounds
    ([parallel.cadence]), or plain data parallel micro-batches (everything else)."""
    if parallel is not None and parallel.pp > 1:
        return PipelineEngine()
    if parallel is not None and parallel.cadence is not None:
        return CadenceEngine(parallel.cadence)
    return DataParallel()


def apply_plans(model: nn.Module, parallel: ParallelSection, world_size: int, device: torch.device) -> Parallelized:
    """Parallelize `model` in place; its data rank must be the one `data_shard` promised the loader."""
    par = parallelize(model, parallel, world_size=world_size, device=device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    assert (par.data_rank, par.data_shards) == data_shard(parallel, rank, world_size), "mesh layout changed"
    if rank == 0 and world_size > 1:  # what the run is split by, in the log of every multi-process run
        split = " x ".join(f"{n} {getattr(par.degrees, n)}" for n in DIMS if getattr(par.degrees, n) > 1)
        print(f"parallel: {split}" + (" (FSDP)" if par.fsdp else " (DDP)" if par.wrap_ddp else ""))
    return par


def is_sharded_run(par: Parallelized | None) -> bool:
    """Weights are DTensors (a mesh was built): checkpoints go through DCP, each rank its own shards.
    A cp mesh under DDP keeps whole weights: plain checkpoints."""
    return par is not None and par.mesh is not None and not par.wrap_ddp


def save_sharded_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any] | None, rng_states: list[dict[str, Any]]) -> Path:
    """Every rank writes its shards into RUN_DIR/.ckpt-N.tmp; rank 0 seals it (manifest) and renames it.

    `trainer_state` is rank 0's (None elsewhere). Collective: every rank must call it.
    """
    final, tmp = run_dir / ckpt.ckpt_name(step), run_dir / f".{ckpt.ckpt_name(step)}.tmp"
    main = trainer_state is not None
    if main and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while saving this very step
    if dist.is_initialized():
        dist.barrier()  # nobody writes shards into the directory rank 0 is clearing
    save_sharded(tmp, model, optimizer)  # ends in a barrier: every rank's shards are down
    if trainer_state is not None:  # rank 0
        ckpt.fault_point("ckpt", step)  # crash-safety tests kill here: shards on disk, no manifest yet
        ckpt.seal_checkpoint(run_dir, tmp, step, trainer_state, rng_states)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_sharded_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> None:
    """Model and optimizer state of a checkpoint into a live (possibly parallelized) model, each rank its shards."""
    if is_sharded(path) != sharded:
        have, want = ("sharded (DCP)", "plain") if is_sharded(path) else ("plain", "sharded (DCP)")
        raise KilnError(f"{path} is a {have} checkpoint but this run's [parallel] plan keeps {want} ones; resume "
                        f"with the parallel.fsdp / tp / ep of the run that wrote it")
    load_sharded(path, model, optimizer)


def place_frozen(model: nn.Module, device: torch.device, plan: Parallelized | None, parallel: ParallelSection | None,
                 fast: bool) -> nn.Module:
    """A frozen model beside the trained one (a DPO or GRPO reference), ready to run: on the run's device, its
    fast/exact switch as the trained model's, and under FSDP sharded as the trained one is (each rank holds its
    share; FSDP gathers each block for its forward). Returns the model (sharded in place)."""
    model.requires_grad_(False).eval()
    # a copy of a model built on meta (kiln.parallel.sharded_load: the run reads its weights shard by shard) has
    # no weights yet: it reads its own share once sharded, as the policy did
    pending = model.deferred_read if isinstance(model, PreTrainedModel) else None
    if pending is None:
        model.to(device)
    if plan is not None and plan.fsdp:
        d = plan.degrees
        if d.tp > 1 or d.ep > 1 or d.cp > 1 or d.pp > 1:
            raise ConfigError("a frozen reference model is sharded over parallel.dp only; with parallel.tp / ep / cp "
                              "/ pp use [lora] (the reference is the base) or precomputed reference log-probs")
        assert parallel is not None, "an FSDP plan comes from a [parallel] table"
        assert plan.mesh is not None, "an FSDP plan has its device mesh"
        apply_fsdp(model, plan.mesh["dp"], parallel.param_dtype, parallel.reduce_dtype, parallel.offload)
    if pending is not None and isinstance(model, PreTrainedModel):  # (pending: it is one)
        read_shards(model, pending.index, device)
    set_fast(model, fast)
    return model
