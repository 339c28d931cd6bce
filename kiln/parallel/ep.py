"""Expert parallelism for stacked-expert MoE layers (qwen3_moe): experts split over the ep ranks.

The experts are where the family's parallel plan says (`experts`, per block; dense blocks have none).

Each ep rank keeps E/ep experts (the stacked weights become DTensors sharded on the expert axis,
so checkpoints and `full_tensor()` still see the whole stack) and its own tokens. Per MoE layer:

  1. route locally; sort the (token, slot) pairs by expert, so they are grouped by owning rank;
  2. all-to-all the per-expert counts, then the token rows, to the ranks that own their experts;
  3. regroup the received rows by local expert and run the two grouped matmuls;
  4. all-to-all the results back, scale by the routing weights, unsort and sum the k slots.

Both all-to-alls are differentiable (the backward is the same exchange reversed). gloo on CPU
supports `all_to_all_single` with uneven splits in torch 2.13, so CPU tests use the real path.

With tensor parallelism (the ("ep", "tp") dimensions of one mesh) an ep group is the ranks that share a
tp rank. The tp ranks of a group route the same whole tokens (tp.py gathers the sequence before the
router); each sends its 1/tp share of them to its own ep peers, so the tp ranks hold equal expert
shards whose gradients are partial sums, added up over tp after the backward.
With fsdp, each expert shard is an FSDP unit of its own over dp (`shard_experts`); the rest of the
model is sharded over dp x ep, the ranks that read different data.

Routed experts kept FP8 (`model.fp8 = "keep"`, `Fp8Experts`) split as stored: each rank keeps its experts'
FP8 stacks and their scale grids (both sharded on the expert axis; split as bytes, which every backend
carries) and dequantizes only those when they compute (`ExpertParallelFp8Experts`).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln.errors import ConfigError
from kiln.hub.fp8 import SCALE_SUFFIX, is_quantized
from kiln.models.common.fp8 import Fp8Experts, dequantize_parts
from kiln.models.common.lora_experts import HOLDER
from kiln.models.common.moe import Experts, grouped_linear
from kiln.parallel.blocks import model_name, part, plan_blocks, plan_of
from kiln.parallel.fsdp import DTYPES, retype


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` go to each rank; `recv` rows come back from each. Backward reverses it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all over the first axis."""
    return _AllToAll.apply(x, recv, send, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(Experts):
    """`Experts` whose stacked weights are sharded over an ep group; tokens travel to their experts.

    Installed by `apply_expert_parallel` by switching the class of a built `Experts` module, so its
    parameter names and the family's key map stay as they are.
    """

    ep_group: dist.ProcessGroup
    ep_size: int

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, k = index.shape  # x (N, C); index, weights (N, k)
        P, E = self.ep_size, self.num_experts
        local_experts = E // P
        expert_of, order = torch.sort(index.reshape(-1))  # (S,) pairs grouped by expert, hence by owner rank
        xs = x[order // k]  # (S, C)
        ws = weights.reshape(-1)[order]
        counts = torch.bincount(expert_of, minlength=E)  # (E,)
        recv_counts = torch.empty_like(counts)  # (P * E_l,): per source rank, rows for each local expert
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send = counts.view(P, local_experts).sum(1).tolist()
        recv = recv_counts.view(P, local_experts).sum(1).tolist()
        xr = all_to_all(xs, recv, send, self.ep_group)  # (R, C): by source rank, then by local expert
        # regroup the received rows by local expert (stable: source-rank order within an expert)
        local_e = torch.arange(local_experts, device=x.device).repeat(P).repeat_interleave(recv_counts)
        by_expert = torch.sort(local_e, stable=True).indices
        offsets = torch.cumsum(recv_counts.view(P, local_experts).sum(0), dim=0, dtype=torch.int32)
        h = xr[by_expert]
        y = grouped_linear(self.glu(grouped_linear(h, _local(self.stacked("gate_up_proj")), offsets)),
                           _local(self.stacked("down_proj")), offsets)  # (R, C)
        y = y[torch.argsort(by_expert)]  # back to the received order
        ys = all_to_all(y, send, recv, self.ep_group) * ws.unsqueeze(-1)  # (S, C), in our sorted order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.size(0), device=x.device)
        return ys[back].view(N, k, -1).sum(dim=1).to(x.dtype)  # (N, C)


class ExpertParallelFp8Experts(ExpertParallelExperts, Fp8Experts):
    """`ExpertParallelExperts` over routed experts kept FP8 (`fp8 = "keep"`): each rank holds its experts' FP8
    stacks and their scale grids (DTensors sharded on the expert axis) and dequantizes only those when they
    compute, as `Fp8Experts` does for all of them in one process."""

    def _weight(self, name: str) -> torch.Tensor:
        p = self._parameters[name]
        assert p is not None, f"{name}: one of the experts' stacks"
        q = _local(p)
        if not is_quantized(q):
            return q
        scale = self._buffers[name + SCALE_SUFFIX]
        assert scale is not None, f"{name}: an FP8 stack has its scale grid"
        parts, dim = self.fp8_layout[name]
        return dequantize_parts(q, _local(scale), self.fp8_block, parts, dim, self.compute_dtype)


def _split(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`t` (E, ...) sharded on the expert axis over `mesh`, rank 0's values; a dtype a backend may lack (FP8)
    crosses as its bytes (gloo has no float8)."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return retype(distribute_tensor(t.view(torch.uint8), mesh, [Shard(0)]), t.dtype)
    return distribute_tensor(t, mesh, [Shard(0)])


def expert_modules(model: nn.Module) -> list[Experts]:
    """The stacked-expert modules the model's plan points at, in block order ([] without any)."""
    plan = plan_of(model)
    if plan is None or plan.experts is None:
        return []
    found: list[Experts] = []
    for m in (part(block, plan.experts) for block in plan_blocks(model, plan)):
        if m is None:
            continue
        if not isinstance(m, Experts):
            raise ConfigError(f"{model_name(model)}: its plan's experts ({plan.experts}) is a {type(m).__name__}, "
                              f"not stacked Experts; expert parallelism cannot split it")
        found.append(m)
    return found


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split the model's planned expert modules over the 1-D ep `mesh` in place; returns the model."""
    size = mesh.size()
    experts = expert_modules(model)
    if not experts:
        raise ConfigError(f"parallel.ep = {size}: {model_name(model)} has no mixture-of-experts layer to split")
    for module in experts:
        if module.num_experts % size:
            raise ConfigError(f"parallel.ep = {size} does not divide the model's num_experts ({module.num_experts})")
        if HOLDER in module._modules:  # common/lora_experts.py: the adapted weight is read whole
            raise ConfigError(f"parallel.ep = {size}: LoRA on routed experts (lora.target_parameters) does not run "
                              "expert-parallel yet; use fsdp or dp")
        for name in ("gate_up_proj", "down_proj"):
            p = module._parameters[name]  # an FP8-kept stack as stored (the attribute reads it dequantized)
            assert p is not None, f"{name}: one of the experts' stacks"
            setattr(module, name, nn.Parameter(_split(p.data, mesh), requires_grad=p.requires_grad))
            scale = module._buffers.get(name + SCALE_SUFFIX)
            if scale is not None:  # one scale grid per expert: each rank keeps its experts' grids
                module._buffers[name + SCALE_SUFFIX] = _split(scale, mesh)
        module.__class__ = ExpertParallelFp8Experts if isinstance(module, Fp8Experts) else ExpertParallelExperts
        ep = cast(ExpertParallelExperts, module)  # its class was switched on the line above
        ep.ep_group, ep.ep_size = mesh.get_group(), size
    return model


def shard_experts(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: str | None = None,
                  reduce_dtype: str = "fp32", offload: bool = False) -> None:
    """FSDP units of their own for the expert-parallel experts, sharded over `dp_mesh` (before `apply_fsdp`).

    The rest of the model is sharded over every rank that reads different data (dp x ep), but an
    expert shard is replicated over dp only: FSDP averages its gradient over dp, and since that
    gradient already sums its ep group's tokens (the all-to-all brought them), the caller divides it
    by ep after the backward (`Parallelized.sync_gradients`; a gradient divide factor would need a
    pre-multiplied reduce-scatter, which gloo lacks).
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                                  reduce_dtype=DTYPES[reduce_dtype])
    placement: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for module in expert_modules(model):
        fully_shard(module, mesh=dp_mesh, mp_policy=policy, offload_policy=placement)
