"""Parallel degrees from the [parallel] table, checked against the world size and the model, and the mesh.

The mesh has three named dimensions, outermost first: ("dp", "ep", "tp"). Ranks next to each other
share a tensor-parallel group (the chattiest traffic stays closest); expert-parallel ranks also split
the batch, so the ranks that read different data are dp * ep of them ("batch" below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.errors import ConfigError

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


def check_model(degrees: Degrees, config: Any, fsdp: bool = False) -> None:
    """Refuse degrees the model's shapes cannot be split by, naming the key and the numbers."""
    tp, ep = degrees.tp, degrees.ep
    if tp > 1:
        heads = getattr(config, "num_attention_heads", None)
        if heads is None or not hasattr(config, "kv_heads"):
            raise ConfigError(f"parallel.tp = {tp}: tensor parallelism has a plan for the decoder families only "
                              f"(llama, qwen2, qwen3, qwen3_moe), not {getattr(config, 'model_type', '?')}")
        for key, n in (("num_attention_heads", heads), ("num_key_value_heads", config.kv_heads),
                       ("intermediate_size", config.intermediate_size)):
            if n % tp:
                raise ConfigError(f"parallel.tp = {tp} does not divide the model's {key} ({n}); "
                                  f"choose a tp that divides it")
        if getattr(config, "num_experts", 0):
            raise ConfigError("parallel.tp > 1 with a MoE model is not supported; split its experts with parallel.ep")
    if ep > 1:
        experts = getattr(config, "num_experts", 0)
        if not experts:
            raise ConfigError(f"parallel.ep = {ep} needs a mixture-of-experts model (num_experts > 0); "
                              f"{getattr(config, 'model_type', 'this model')} has no experts")
        if experts % ep:
            raise ConfigError(f"parallel.ep = {ep} does not divide the model's num_experts ({experts}); "
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
