"""Parallel degrees from the [parallel] table, checked against the world size and the model, and the mesh.

The mesh has three named dimensions, outermost first: ("dp", "ep", "tp"). Ranks next to each other
share a tensor-parallel group (the chattiest traffic stays closest); expert-parallel ranks also split
the batch, so the ranks that read different data are dp * ep of them ("batch" below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.errors import ConfigError
from kiln.parallel.blocks import model_name
from kiln.parallel.ep import expert_modules
from kiln.parallel.tp import tensor_plan

DIMS = ("dp", "ep", "tp")


@dataclass(frozen=True)
class Degrees:
    dp: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.tp

    @property
    def batch(self) -> int:
        """How many ranks read different batches (data-parallel and expert-parallel ranks)."""
        return self.dp * self.ep


def resolve_degrees(parallel: Any, world_size: int) -> Degrees:
    """dp, ep, tp from a ParallelSection (dp 0 = what is left), required to multiply to `world_size`."""
    tp, ep, dp = int(parallel.tp), int(parallel.ep), int(parallel.dp)
    if dp == 0:
        if world_size % (tp * ep):
            raise ConfigError(f"parallel.tp ({tp}) x parallel.ep ({ep}) = {tp * ep} does not divide the world size "
                              f"({world_size} processes); choose degrees whose product divides it")
        dp = world_size // (tp * ep)
    if dp * tp * ep != world_size:
        raise ConfigError(f"parallel degrees dp ({dp}) x ep ({ep}) x tp ({tp}) = {dp * ep * tp}, but the world size "
                          f"is {world_size} processes; they must multiply to the world size (or set parallel.dp = 0)")
    return Degrees(dp=dp, ep=ep, tp=tp)


def check_model(degrees: Degrees, model: nn.Module, fsdp: bool = False) -> None:
    """Refuse degrees the model's plan or shapes cannot be split by, naming the key and the numbers."""
    tp, ep = degrees.tp, degrees.ep
    if tp > 1:
        tensor_plan(model, tp)
    if ep > 1:
        experts = expert_modules(model)
        if not experts:
            raise ConfigError(f"parallel.ep = {ep} needs a mixture-of-experts model; {model_name(model)} has no experts")
        n = experts[0].num_experts
        if n % ep:
            raise ConfigError(f"parallel.ep = {ep} does not divide the model's num_experts ({n}); "
                              f"choose an ep that divides it")
        if fsdp or tp > 1:
            raise ConfigError("parallel.ep > 1 combines with plain data parallelism only (fsdp = false, tp = 1)")


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """The ("dp", "ep", "tp") mesh over the default process group (joined already)."""
    return init_device_mesh(device_type, (degrees.dp, degrees.ep, degrees.tp), mesh_dim_names=DIMS)


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that read different data, as one dimension ("dp" and "ep" flattened)."""
    return mesh["dp", "ep"]._flatten("batch")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
