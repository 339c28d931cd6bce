"""Tensor parallelism over Linears kept FP8 (`[model] fp8 = "keep"`): each rank its FP8 rows or columns and their scales.

An FP8 Linear (`FP8Linear`, or a LoRA layer over one) holds a float8 weight (out, in) and a grid of block
scales (ceil(out / bm), ceil(in / bn)) beside it. A column-parallel split takes each rank's output rows of
both (Shard(0)), a row-parallel one its input columns of both (Shard(1)), so a rank holds exactly the scale
blocks of its piece and dequantizes only that piece per matmul (kiln.models.common.fp8.fp8_linear). That
needs each rank's share to be whole blocks; a split that would cut one is refused by name (`check_fp8_splits`).
The FP8 bytes are split as uint8 (gloo has no float8), as FSDP2 (`frozen_as_bytes`) and ep do; a
per-tensor scale (no blocks) is one number and stays whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln.errors import ConfigError
from kiln.hub.fp8 import FP8, SCALE_SUFFIX
from kiln.models.parallel_plan import ParallelPlan
from kiln.parallel.blocks import model_name, part, plan_blocks
from kiln.parallel.fsdp import retype

if TYPE_CHECKING:
    from kiln.models.common.fp8 import FP8Linear
    from kiln.models.common.lora import LoraLinear


def _is_fp8_linear(module: nn.Module | None) -> TypeGuard[FP8Linear | LoraLinear]:
    """An nn.Linear whose weight is FP8 with its block scales beside it (FP8Linear, or LoRA over one: the only
    Linears that hold an FP8 weight with a scale buffer)."""
    return isinstance(module, nn.Linear) and module.weight.dtype == FP8 and "weight" + SCALE_SUFFIX in module._buffers


def fp8_splits(model: nn.Module, plan: ParallelPlan) -> Iterator[tuple[str, FP8Linear | LoraLinear, int]]:
    """(path, module, split dim: 0 rows / 1 columns) of every FP8 Linear the plan's colwise / rowwise styles split."""
    for i, block in enumerate(plan_blocks(model, plan)):
        for names, dim in ((plan.colwise, 0), (plan.rowwise, 1)):
            for name in names:
                module = part(block, name)
                if _is_fp8_linear(module):
                    yield f"{plan.blocks}.{i}.{name}", module, dim


def _whole_blocks(n: int, block: int, tp: int) -> bool:
    """Whether torch.chunk's split of n rows over tp ranks (the first ranks ceil(n / tp) each, as Shard does) gives
    each rank whole blocks of `block` rows, and the split of the ceil(n / block) scale rows the same blocks."""
    step = -(-n // tp)
    return step % block == 0 and -(-math.ceil(n / block) // tp) == step // block


def check_fp8_splits(model: nn.Module, plan: ParallelPlan, tp: int) -> None:
    """A ConfigError naming the first FP8 weight whose tp split would cut one of its scale blocks, its shape, the
    tp degree and the degrees that keep every FP8 weight's blocks whole."""
    splits = [(path, m.weight.shape, dim, m.block) for path, m, dim in fp8_splits(model, plan) if m.block is not None]
    for path, shape, dim, block in splits:
        if _whole_blocks(shape[dim], block[dim], tp):
            continue
        n, b = shape[dim], block[dim]
        fits = [t for t in range(1, max(2, math.ceil(n / b)) + 1)
                if all(_whole_blocks(s[d], bl[d], t) for _, s, d, bl in splits)]
        what = "output rows (column parallel)" if dim == 0 else "input columns (row parallel)"
        raise ConfigError(
            f"parallel.tp = {tp} with model.fp8 = 'keep': {model_name(model)}'s FP8 weight '{path}.weight' "
            f"{tuple(shape)} has {list(block)} scale blocks, and splitting its {n} {what} over {tp} ranks "
            f"({-(-n // tp)} each) would cut a {b}-wide block; tp degrees that keep every FP8 weight's blocks whole: "
            f"{', '.join(map(str, fits))}; or set model.fp8 = 'dequantize' to split it at any tp")


def _split_bytes(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> DTensor:
    """`t` sharded on `dim` over `mesh` (rank 0's values); a one-byte float (FP8, UE8M0 scales) goes as bytes."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return retype(distribute_tensor(t.view(torch.uint8), mesh, [Shard(dim)]), t.dtype)
    return distribute_tensor(t, mesh, [Shard(dim)])


def split_fp8_linears(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh) -> list[str]:
    """Split each FP8 Linear the plan splits, weight and scale grid alike, before the DTensor styles run (which
    then find the weight split already and leave it so); returns their paths."""
    done = []
    for path, module, dim in fp8_splits(model, plan):
        w = module.weight
        module.weight = nn.Parameter(_split_bytes(w.data, mesh, dim), requires_grad=False)
        scale = module._buffers["weight" + SCALE_SUFFIX]
        assert scale is not None, "fp8_splits yields Linears with a scale buffer"
        if module.block is not None:  # a per-tensor scale stays whole (the styles replicate it)
            module._buffers["weight" + SCALE_SUFFIX] = _split_bytes(scale, mesh, dim)
        done.append(path)
    return done
