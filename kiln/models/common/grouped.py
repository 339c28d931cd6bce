"""Grouped matmuls: rows sorted by expert times each expert's weight (the MoE blocks' one kernel)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped_mm kernel runs here (transformers makes the same call); else per-expert mm.

    Its CPU backward needs 16-byte-aligned strides, so training with odd sizes takes the fallback.
    """
    if not hasattr(F, "grouped_mm") or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # no float64 kernel (float64 reference runs take the per-expert loop)
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device) >= (8, 0)
    if w.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
        return all((n * w.element_size()) % 16 == 0 for n in (w.shape[-1], w.shape[-2], x.shape[-1]))
    return True


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (S, in), sorted by expert with cumulative `offsets` (E,), times weight[e]^T (E, out, in)."""
    w = weight.transpose(-2, -1)  # (E, in, out)
    x = x.to(w.dtype)
    if _grouped_mm_ok(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    out = torch.zeros(x.size(0), w.size(2), device=x.device, dtype=x.dtype)  # (S, out)
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host sync; a loop over experts, not tokens
        if end > start:
            out[start:end] = torch.mm(x[start:end], w[e])
        start = end
    return out
