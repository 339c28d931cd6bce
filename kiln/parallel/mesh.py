"""Parallel degrees from the [parallel] table, checked against the world size and the model, and the mesh.

The mesh has five named dimensions, outermost first: ("pp", "dp", "cp", "ep", "tp"). Ranks next to
each other share a tensor-parallel group (the chattiest traffic stays closest); pipeline stages are
the outermost (their traffic is one activation per micro-batch). Expert-parallel ranks also split
the batch, so the ranks that read different data are dp * ep of them ("batch" below); context-
parallel ranks read the same rows and split their sequence; pipeline stages read the same rows too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.errors import ConfigError
from kiln.parallel.blocks import model_name
from kiln.parallel.context import check_model as check_context_model
from kiln.parallel.ep import expert_modules
from kiln.parallel.tp import tensor_plan

DIMS = ("pp", "dp", "cp", "ep", "tp")


@dataclass(frozen=True)
class Degrees:
    dp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep * self.tp

    @property
    def batch(self) -> int:
        """How many ranks read different batches (data-parallel and expert-parallel ranks)."""
        return self.dp * self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (the mesh is laid out row-major over the ranks)."""
        out = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIMS}

    def data_shard(self, rank: int) -> int:
        """Which of the `batch` data shards this rank reads."""
        c = self.coords(rank)
        return c["dp"] * self.ep + c["ep"]


def resolve_degrees(parallel: Any, world_size: int) -> Degrees:
    """The degrees of a ParallelSection (dp 0 = what is left), required to multiply to `world_size`."""
    given = {name: int(getattr(parallel, name, 1)) for name in ("pp", "cp", "ep", "tp")}
    named = " x ".join(f"{name} ({n})" for name, n in given.items() if n > 1) or "1"
    rest = math.prod(given.values())
    dp = int(parallel.dp)
    if dp == 0:
        if world_size % rest:
            raise ConfigError(f"parallel degrees {named} = {rest} do not divide the world size ({world_size} "
                              f"processes); choose degrees whose product divides it")
        dp = world_size // rest
    if dp * rest != world_size:
        raise ConfigError(f"parallel degrees dp ({dp}) x {named} = {dp * rest}, but the world size is {world_size} "
                          f"processes; they must multiply to the world size (or set parallel.dp = 0)")
    return Degrees(dp=dp, **given)


def holds_shards(parallel: Any, world_size: int) -> bool:
    """Whether each rank holds only shards of the weights: fsdp, or tp / ep / pp above 1, over several processes."""
    if parallel is None:
        return False
    d = resolve_degrees(parallel, world_size)  # (refuses degrees that do not fit the world, one process too)
    return world_size > 1 and (bool(parallel.fsdp) or d.tp > 1 or d.ep > 1 or d.pp > 1)


def check_model(degrees: Degrees, model: nn.Module, fsdp: bool = False) -> None:
    """Refuse degrees the model's plan or shapes cannot be split by, naming the key and the numbers."""
    tp, ep = degrees.tp, degrees.ep
    if degrees.cp > 1:
        if tp > 1 or ep > 1 or degrees.pp > 1:
            raise ConfigError(f"parallel.cp = {degrees.cp} combines with dp and fsdp only (tp, ep and pp = 1)")
        check_context_model(model, degrees.cp)
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


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "cp", "ep", "tp") mesh over the default process group (joined already)."""
    return init_device_mesh(device_type, tuple(getattr(degrees, name) for name in DIMS), mesh_dim_names=DIMS)


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that read different data, as one dimension ("dp" and "ep" flattened)."""
    return mesh["dp", "ep"]._flatten("batch")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
