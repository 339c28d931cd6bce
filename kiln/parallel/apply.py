"""From the [parallel] table (kiln.parallel.config.ParallelSection) to a parallelized model: the one entry point the Trainer and tests call.

Order matters and is fixed: tensor parallel, expert parallel, activation checkpointing, compile,
FSDP (the last must see the blocks as they will run). Plain data parallelism (no fsdp/tp/ep) is
left to DDP; `Parallelized.wrap_ddp` says when.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError
from kiln.parallel.blocks import apply_activation_checkpointing, compile_blocks
from kiln.parallel.config import ParallelSection
from kiln.parallel.context import apply_context_parallel
from kiln.parallel.ep import apply_expert_parallel, expert_modules, shard_experts
from kiln.parallel.fsdp import apply_fsdp, frozen_as_bytes
from kiln.parallel.grads import average_gradients
from kiln.parallel.mesh import Degrees, batch_mesh, build_mesh, check_model, resolve_degrees
from kiln.parallel.pipeline import Pipeline, apply_pipeline, check_pipeline
from kiln.parallel.tp import apply_tensor_parallel


def _ep_sharded(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters split by expert parallelism (DTensors over a mesh with an "ep" dimension)."""
    return [p for p in params if _on_ep_mesh(p)]


def _on_ep_mesh(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


@dataclass
class Parallelized:
    model: nn.Module
    degrees: Degrees
    mesh: DeviceMesh | None
    fsdp: bool
    cadence: bool = False  # [parallel.cadence] averages at its own syncs: no DDP
    pipeline: Pipeline | None = None  # pp > 1: the Trainer's pp step runs it

    @property
    def data_rank(self) -> int:
        """Which data shard this rank reads (tp ranks of one group read the same batch)."""
        if self.mesh is None:
            return dist.get_rank() if dist.is_initialized() else 0
        return self.mesh.get_local_rank("dp") * self.degrees.ep + self.mesh.get_local_rank("ep")

    @property
    def data_shards(self) -> int:
        return self.degrees.batch

    @property
    def wrap_ddp(self) -> bool:
        """Plain data parallelism: the caller wraps the model in DDP."""
        # cp ranks too: their loss sums add up to one replica's, so gradients average over dp x cp like dp's
        d = self.degrees
        return not self.cadence and not self.fsdp and d.tp == 1 and d.ep == 1 and d.pp == 1 and d.dp * d.cp > 1

    def sync_gradients(self) -> None:
        """Average gradients where neither DDP nor FSDP does it (tp with dp > 1, ep), and add up the partial
        expert gradients of tp ranks that each ran the experts on their share of the tokens."""
        if self.mesh is not None and self.degrees.tp > 1:
            # each tp rank ran the routed experts on its share of the tokens (tp.py): sum their gradients over tp
            tp_group = self.mesh.get_group("tp")
            average_gradients([p for m in expert_modules(self.model) for p in m.parameters()], tp_group, 1,
                              sharded_group=tp_group)
        if self.mesh is not None and self.fsdp and self.degrees.ep > 1:
            # FSDP averaged the expert shards over dp; each also sums its ep group's tokens: divide by ep
            for p in _ep_sharded(self.model.parameters()):
                if p.grad is not None:
                    p.grad.div_(self.degrees.ep)
        if self.mesh is None or self.fsdp or self.wrap_ddp or self.degrees.batch == 1:
            return
        batch_group = batch_mesh(self.mesh).get_group() if self.degrees.ep > 1 else self.mesh.get_group("dp")
        # ep-sharded experts hold their ep group's sum already: summed over dp; everything else (tp shards
        # included) over every rank that read different data
        params = list(self.model.parameters())
        experts = _ep_sharded(params)
        rest = [p for p in params if not any(p is e for e in experts)]
        dp_group = self.mesh.get_group("dp")
        average_gradients(rest, batch_group, self.degrees.batch, sharded_group=batch_group)
        average_gradients(experts, dp_group, self.degrees.batch, sharded_group=dp_group)


def parallelize(model: nn.Module, parallel: ParallelSection, world_size: int | None = None,
                device: torch.device | None = None) -> Parallelized:
    """Apply the plans a ParallelSection asks for to a built model (on its device), in place."""
    world_size = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    degrees = resolve_degrees(parallel, world_size)
    check_model(degrees, model, fsdp=parallel.fsdp)
    device_type = (device or next(model.parameters()).device).type
    if degrees.pp > 1:
        return _pipelined(model, parallel, degrees, device or next(model.parameters()).device)
    needs_mesh = degrees.tp > 1 or degrees.ep > 1 or degrees.cp > 1 or parallel.fsdp
    mesh = build_mesh(degrees, device_type) if needs_mesh and world_size > 1 else None
    if mesh is not None and degrees.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], parallel.sequence_parallel)
    if mesh is not None and degrees.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
    if mesh is not None and degrees.cp > 1:
        apply_context_parallel(model, mesh.get_group("cp"), parallel.cp_method)
    apply_activation_checkpointing(model, parallel.activation_checkpointing, parallel.checkpoint_every)
    if parallel.compile:
        compile_blocks(model, parallel.compile_backend)
    if mesh is not None and parallel.fsdp:
        # with cp, shards span dp x cp: every rank holds one slice, and gradients average over all of them
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if degrees.cp > 1 else mesh["dp"]
        if degrees.ep > 1:  # experts shard over dp (ep splits them already), the rest over dp x ep
            frozen_as_bytes(model)  # an FP8-kept expert unit holds nothing else: it must cross as bytes
            shard_experts(model, mesh["dp"], parallel.param_dtype, parallel.reduce_dtype, parallel.offload)
            shard_mesh = batch_mesh(mesh)
        apply_fsdp(model, shard_mesh, parallel.param_dtype, parallel.reduce_dtype, parallel.offload)
    return Parallelized(model, degrees, mesh, fsdp=bool(parallel.fsdp and mesh is not None),
                        cadence=parallel.cadence is not None)


def _pipelined(model: nn.Module, parallel: ParallelSection, degrees: Degrees, device: torch.device) -> Parallelized:
    """pp > 1: this rank keeps its stages (kiln.parallel.pipeline), sharded by FSDP over dp when asked."""
    if degrees.tp > 1 or degrees.ep > 1 or degrees.cp > 1:
        raise ConfigError(f"parallel.pp = {degrees.pp} combines with dp (and fsdp) only; got tp = {degrees.tp}, "
                          f"ep = {degrees.ep}, cp = {degrees.cp}")
    check_pipeline(model, parallel)  # before the mesh: a bad split is refused without any collective
    mesh = build_mesh(degrees, device.type)
    pipe = apply_pipeline(model, parallel, mesh, device)
    return Parallelized(model, degrees, mesh, fsdp=bool(parallel.fsdp), pipeline=pipe)
