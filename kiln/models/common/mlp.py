"""The gated MLP of the decoder families: down(act(gate(x)) * up(x)) (SwiGLU with act = silu)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.common.activations import activation


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act_fn = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
