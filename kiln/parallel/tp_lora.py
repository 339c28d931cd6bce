"""Tensor-parallel styles for LoRA layers (kiln.models.common.lora.LoraLinear): the base split as a Linear, the
adapters so that the low-rank update splits the same way.

Column parallel (output rows split): B (out, r) splits by rows with the base, A (r, in) stays whole, so each
rank makes its output columns of B A x; A's gradient is then a partial sum over the ranks (DTensor adds it up).
Row parallel (input columns split): A splits by columns with the base, B stays whole; A x is a partial sum,
and so is B A x, added to the base's partial output before the one reduction. torch's own styles split every
parameter of the module tree alike (and cannot name a submodule's), hence these.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def _split(style, placements: dict[str, dict[str, Placement]], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Distribute `module`'s own parameters as `placements[name]` says (what it leaves, distribute_module
    replicates)."""
    for key, placement in placements.get(name, {}).items():
        p = module._parameters.get(key)
        if p is not None:
            module.register_parameter(key, nn.Parameter(
                distribute_tensor(p, mesh, [placement], src_data_rank=style.src_data_rank), requires_grad=p.requires_grad))


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRA layer: base weight, bias and B by output rows; A whole."""

    PLACEMENTS: ClassVar[dict[str, dict[str, Placement]]] = {"": {"weight": Shard(0), "bias": Shard(0)}, "lora_B": {"weight": Shard(0)}}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _split(self, self.PLACEMENTS, name, module, device_mesh)


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRA layer: base weight and A by input columns; bias and B whole."""

    PLACEMENTS: ClassVar[dict[str, dict[str, Placement]]] = {"": {"weight": Shard(1), "bias": Replicate()}, "lora_A": {"weight": Shard(1)}}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _split(self, self.PLACEMENTS, name, module, device_mesh)


def is_lora(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear) and isinstance(getattr(module, "lora_A", None), nn.Linear)
