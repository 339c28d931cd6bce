"""Typed views of torch's module containers.

`nn.ModuleList` holds `nn.Module`s as far as a type checker knows, so a model reading its own layers' attributes
(`layer.attn.qkv_proj`) would get `Tensor | Module` back. `members` gives the list as the class the model put in
it, checked: a member of another class (a plan or a hook that swapped one) is named, not read as the wrong thing.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from kiln.errors import KilnError

M = TypeVar("M", bound=nn.Module)


def members(container: nn.ModuleList, cls: type[M], what: str = "layer") -> list[M]:
    """The modules of `container`, each an instance of `cls` (else a KilnError naming the `what` at fault)."""
    out: list[M] = []
    for i, m in enumerate(container):
        if not isinstance(m, cls):
            raise KilnError(f"{what} {i}: a {type(m).__name__}, not the {cls.__name__} this model built there")
        out.append(m)
    return out
