"""RMSNorm as the Llama/Qwen families compute it: statistics in float32, scale applied after the cast back.

Also the zero-centred variant (scale 1 + w, Qwen3-Next / Qwen3.5) and the gated output norm of the
Gated DeltaNet (norm, then times silu(gate)).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)  # bf16/fp16 inputs: the mean of squares would lose precision
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)  # weight first: the product order HF uses

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight w is an offset: the scale is (1 + w), applied in float32 before the cast back.

    Qwen3-Next / Qwen3.5 keep w near 0 (weight decay pulls the scale towards 1, not 0). HF init is w = 0.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def after_init(self) -> None:
        nn.init.zeros_(self.weight)  # the generic init sets norm weights to 1, which here means a scale of 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)  # scale in float32, then cast (not Llama's order)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero-centred"


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * silu(gate): the output norm of the Gated DeltaNet, one head (last dim) at a time."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        h = h * F.silu(gate.to(torch.float32))  # the gate acts after the norm, in float32
        return h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Fp32ScaleRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normalised value, cast once at the end (DeepSeek-V4).

    Same numbers as RMSNorm in float32; in bf16 the product is taken before the rounding, not after.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class UnweightedRMSNorm(nn.Module):
    """x / rms(x) with no scale (DeepSeek-V4's per-head query norm and hyper-connection input norm).

    The statistic is taken in float32 and cast to x's dtype before the product, as transformers does.
    """

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, unweighted"
