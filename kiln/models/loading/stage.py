"""The host memory a read straight to the device passes through (kiln.parallel.sharded_load, `device = "cuda"`).

A piece read as stored goes from the file to its device tensor in chunks through one reusable host buffer of at
most `HostStage.limit` bytes (pinned for CUDA); a piece that needs a tensor step or a column slice passes one
tensor at a time. So the host never holds the model, only that buffer (`peak`: what the tests check).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.hub.weights import read_into


class HostStage:
    """The host memory a read to another device passes through: one reusable buffer of at most `limit` bytes
    for tensors read as stored, and one whole tensor at a time for the rest. `peak` is the most host bytes
    one piece took (what a test of "the host never holds the model" checks)."""

    def __init__(self, limit: int = 64 << 20, pin: bool = False):
        if limit < 1:
            raise ValueError(f"HostStage limit must be at least 1 byte, got {limit}")
        self.limit, self.pin, self.peak = limit, pin, 0
        self._buf: torch.Tensor | None = None

    def read(self, f: Any, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor `out` (any device) with the `out.nbytes` bytes at `offset` of file `f`,
        chunk by chunk through the buffer; each copy is synchronous, so the buffer is free again after it."""
        flat = out.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), self.limit):
            n = min(self.limit, flat.numel() - start)
            if self._buf is None or self._buf.numel() < n:
                self._buf = None  # the old buffer goes before the new one comes
                self._buf = torch.empty(min(self.limit, flat.numel()), dtype=torch.uint8, pin_memory=self.pin)
            chunk = self._buf[:n]
            read_into(f, offset + start, chunk)
            flat[start:start + n].copy_(chunk)
            self.note(n)

    def note(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)


def host_stage(device: torch.device) -> HostStage | None:
    """The staging a read to `device` needs: none for host memory (the read goes straight into the tensors)."""
    if device.type in ("cpu", "meta"):
        return None
    return HostStage(pin=device.type == "cuda" and torch.cuda.is_available())
