"""A resume whose checkpoint fails to load falls back to the previous complete one.

`latest_checkpoint` already skips checkpoints that fail their manifest, headers or structure
(`kiln.train.ckpt_check`). What fails only against the live run (a tensor of another shape or kind in
the model or the optimizer state, a DCP shard that does not read) raises a `CheckpointLoadError` from
the loaders here; the Trainer then takes the previous checkpoint that verifies and passes the same
resume checks, printing one line naming the file and why. When none is left, the refusal lists each
checkpoint's reason. Every rank reads the same files (DCP gathers every rank's error), so all ranks fall
back together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.train import checkpoint as ckpt
from kiln.train import plans
from kiln.train.ckpt_check import PER_ELEMENT, CheckpointLoadError, loading
from kiln.train.optim import param_groups
from kiln.train.resume import check_resume

# `trainer` below is a kiln.train.Trainer in its setup (typed Any: the Trainer imports this module)


def previous(trainer: Any, failed: Path, error: CheckpointLoadError) -> Path:
    """The checkpoint before `failed` that verifies and passes `check_resume` (its reshard and notes set on
    the trainer); a KilnError naming every checkpoint's reason when there is none."""
    reasons = trainer.__dict__.setdefault("_load_failures", [])
    reasons.append(f"{failed.name}: {error.file} cannot be loaded ({error.why})")
    if trainer.world.main:
        print(f"resume: {reasons[-1]}; using the previous checkpoint")
    named = ckpt.CKPT_RE.match(failed.name)
    assert named is not None, failed  # a checkpoint directory (ckpt-N) failed to load
    step = int(named.group(1))
    for older_step, path in reversed(ckpt.list_checkpoints(failed.parent)):
        if older_step >= step:
            continue
        problem = ckpt.verify_checkpoint(path, resume=True)
        if problem is None:
            state = ckpt.read_trainer_state(path)
            trainer.reshard, trainer.config_notes = check_resume(path, state, trainer.fingerprint,
                                                                 trainer.run_config, trainer.data_shards)
            return path
        reasons.append(f"{path.name}: {problem}")
        if trainer.world.main:
            print(f"resume: {reasons[-1]}; using the previous checkpoint")
    raise KilnError(f"{failed.parent}: no checkpoint can be resumed from: " + "; ".join(reasons)
                    + ". Start a new run in another train.out_dir, or restore a checkpoint")


def _fits(trainer: Any, state: dict, path: Path) -> None:
    """The optimizer state's per-element tensors have their parameters' shapes and floating dtypes (torch's
    load_state_dict checks neither; the first step would fail). Parameters are numbered as the default
    optimizer numbers them; a custom optimizer factory is not checked here."""
    if trainer.optimizer_factory is not None:
        return
    params = [p for g in param_groups(trainer.model, trainer.args.weight_decay) for p in g["params"]]
    for pid, values in state["state"].items():
        for name, v in values.items():
            if name not in PER_ELEMENT or not isinstance(v, torch.Tensor) or pid >= len(params):
                continue
            if tuple(v.shape) != tuple(params[pid].shape) or not v.is_floating_point():
                raise CheckpointLoadError(path, "optimizer.safetensors", f"tensor '{pid}.{name}' is {v.dtype} "
                                          f"{tuple(v.shape)}, but parameter {pid} is {params[pid].dtype} "
                                          f"{tuple(params[pid].shape)}")


def read_whole(trainer: Any, path: Path) -> tuple[Path, dict, list[dict[str, Any]]]:
    """A plain checkpoint's weights into the (not yet parallelized) model, and its optimizer state and RNG
    states read: (the checkpoint used, optimizer state, RNG states). Falls back on a load failure; the
    weights copy only after every tensor checks, so a fallback overwrites whatever a failed one left."""
    while True:
        try:
            ckpt.load_model_weights(path, trainer.model)
            optim = ckpt.load_optimizer_state(path)
            _fits(trainer, optim, path)
            return path, optim, ckpt.read_rng_states(path)
        except CheckpointLoadError as e:
            path = previous(trainer, path, e)


def load_sharded(trainer: Any, path: Path, sharded: bool) -> Path:
    """A sharded checkpoint's model and optimizer state into the live run (`plans.load_sharded_checkpoint`),
    falling back on a shard that does not read; returns the checkpoint used."""
    while True:
        try:
            if plans.is_sharded(path) != sharded:  # another plan, not a bad file: refused as it is
                plans.load_sharded_checkpoint(path, trainer.model, trainer.optimizer, sharded)
            with loading(path, "dcp/"):
                plans.load_sharded(path, trainer.model, trainer.optimizer)
            return path
        except CheckpointLoadError as e:
            path = previous(trainer, path, e)
