"""Build on meta, shard, then read: each process holds and reads only its share of a checkpoint.

    model = lean_pretrained(path, task, seed)             # the load plan's model, on the meta device: no memory
    parallelize(model, parallel, world_size, device)      # FSDP2 / TP / EP / PP plans, applied on meta
    read_shards(model, path, device)                      # each rank: its pieces, from the files

The plan and its one materialization live below, in kiln.models.loading (a whole load, `load_pretrained`, is the same
path on one process); these are the names the Trainer and `kiln plan` call them by.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.errors import WeightsError
from kiln.hub.index import CheckpointIndex
from kiln.models.auto import plan_load, read_pretrained
from kiln.models.common.load_plan import LoadPlan
from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.loading.fresh import init_adapters
from kiln.models.loading.read import loaded_bytes, materialize

__all__ = ["empty_pretrained", "init_adapters", "lean_pretrained", "load_to_device", "loaded_bytes", "read_plan",
           "read_shards"]


def lean_pretrained(path: str | os.PathLike, task: str | None, seed: int | None, fp8: str = "dequantize",
                    quantize: str | None = None, **changes: Any) -> PreTrainedModel | None:
    """The load plan's model on meta when the checkpoint can be read shard by shard, else None: every rank loads it
    whole (the plan's `whole` says why). Its `deferred_read` (the plan) is what the Trainer reads it by
    (`init_adapters`, `read_shards`)."""
    model, plan = plan_load(path, task, fp8, quantize, seed, **changes)
    return model if plan.whole is None else None


def read_plan(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize",
              quantize: str | None = None, **changes: Any) -> tuple[PreTrainedModel | None, LoadPlan]:
    """The load plan from the headers only (`kiln plan`): the model on meta (None where the headers cannot be taken
    so) and the plan (its `whole`: why every rank loads the checkpoint whole; None: it reads shard by shard)."""
    return plan_load(path, task, fp8, quantize, tokenizer=False, **changes)


def empty_pretrained(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize",
                     quantize: str | None = None, **changes: Any) -> PreTrainedModel:
    """The load plan's model on meta, for `read_shards` (a checkpoint whose plan says whole too: the tests build
    what its family decides)."""
    model, plan = plan_load(path, task, fp8, quantize, tokenizer=False, **changes)
    if model is None:
        raise WeightsError(plan.whole)  # (a .bin not stored in place, a 4-bit base no read takes)
    return model


def load_to_device(path: str | os.PathLike, device: torch.device | str, task: str | None = None,
                   seed: int | None = None, fp8: str = "dequantize", quantize: str | None = None,
                   **changes: Any) -> PreTrainedModel | None:
    """The model read file -> `device` tensor by tensor on one process (kiln.models.auto.read_pretrained); None where
    one process loads it whole."""
    return read_pretrained(path, device, task, seed, fp8, quantize, **changes)


def read_shards(model: PreTrainedModel, path: str | os.PathLike | CheckpointIndex, device: torch.device | str = "cpu",
                stage: Any = None) -> None:
    """This rank's pieces of `model` (built from its plan, the parallel plans applied): kiln.models.loading.read."""
    materialize(model, path, device, stage)
