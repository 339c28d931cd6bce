"""Typed views of torch's module containers.

`nn.ModuleList` holds `nn.Module`s as far as a type checker knows, so a model reading its own layers' attributes
(`layer.attn.qkv_proj`) would get `Tensor | Module` back. `members` gives the list as the class the model put in
it, checked: a member of another class (a plan or a hook that swapped one) is named, not read as the wrong thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard, TypeVar

from torch import nn

from kiln.errors import KilnError

if TYPE_CHECKING:  # (a type only: pretrained stands on the blocks that ask this)
    from kiln.models.common.pretrained import PreTrainedModel

M = TypeVar("M", bound=nn.Module)


def members(container: nn.ModuleList, cls: type[M], what: str = "layer") -> list[M]:
    """The modules of `container`, each an instance of `cls` (else a KilnError naming the `what` at fault)."""
    out: list[M] = []
    for i, m in enumerate(container):
        if not isinstance(m, cls):
            raise KilnError(f"{what} {i}: a {type(m).__name__}, not the {cls.__name__} this model built there")
        out.append(m)
    return out


def is_kiln_model(model: nn.Module) -> TypeGuard[PreTrainedModel]:
    """Whether `model` is a kiln model (a PreTrainedModel: its family and config set by Family.build), asked by
    the blocks below kiln.models.common.pretrained without importing it (the import would run upward)."""
    return hasattr(model, "family") and hasattr(model, "config") and hasattr(model, "load_hf_state_dict")
