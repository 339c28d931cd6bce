"""The checks every kiln op runs on its operands before C sees a raw pointer (and its fake implementation runs
under torch.compile, so a wrong shape fails at trace time): a ValueError naming the op, the tensor and, for a
mismatch, both tensors' shapes."""

from __future__ import annotations

import torch


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def tensor(op: str, name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int | None,
           contiguous: bool = False) -> None:
    """`t` is a CPU tensor of `dtype` (or one of them) with `ndim` dimensions (None: any), and (where the C code
    walks it as one block of memory or writes it in place) contiguous."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} {_shape(t)} must be on the CPU, not {t.device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} {_shape(t)} must be {want}, not {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimension(s), not shape {_shape(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} {_shape(t)} must be contiguous (the kernel walks or writes it as one "
                         f"block), not strides {tuple(t.stride())}")


def same(op: str, name: str, t: torch.Tensor, dim: int, other_name: str, other: torch.Tensor,
         other_dim: int) -> None:
    """Size `dim` of `t` equals size `other_dim` of `other`."""
    if t.shape[dim] != other.shape[other_dim]:
        raise ValueError(f"{op}: {name} {_shape(t)} and {other_name} {_shape(other)} do not fit: {name}'s size "
                         f"{dim} ({t.shape[dim]}) must equal {other_name}'s size {other_dim} ({other.shape[other_dim]})")


def count(op: str, name: str, t: torch.Tensor, want: int, why: str) -> None:
    """`t` holds `want` values (`why` says where the number comes from, naming the other tensor and its shape)."""
    if t.numel() != want:
        raise ValueError(f"{op}: {name} {_shape(t)} holds {t.numel()} values, not the {want} {why}")
