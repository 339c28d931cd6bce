"""Named scratch tensors on the CPU, per thread, reused across calls: the temporaries of the kernels' ops and of
the torch paths beside them (kiln.models.common.qlora, quant4). Fresh ones at every matmul left glibc's heap
with hundreds of MB of freed blocks between a training step's activations."""

from __future__ import annotations

import threading

import torch


class _Scratch(threading.local):
    """Per thread: (name, dtype) -> one flat buffer, kept for the thread's life (at bench_qlora's 1.2B Qwen3
    shape, 50 MB of float32 at 1,024 tokens)."""

    def __init__(self):
        self.flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_SCRATCH = _Scratch()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` for a temporary that dies within one call (a float32 copy of an activation),
    from one flat buffer per (name, dtype) on this thread, grown as needed. Valid until the next call with
    this name."""
    n = 1
    for s in shape:
        n *= s
    key = (name, dtype)
    flat = _SCRATCH.flat.get(key)
    if flat is None or flat.numel() < n:
        _SCRATCH.flat.pop(key, None)  # the old one goes before the larger one comes
        with torch.inference_mode(False):
            flat = _SCRATCH.flat[key] = torch.empty(n, dtype=dtype)
    return flat[:n].view(shape)
