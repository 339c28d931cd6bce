"""Activations chosen by HF's `hidden_act` strings, each computed with HF's exact formula.

GELU comes in one parametrised module: `exact` (erf, torch's kernel), `tanh` (torch's tanh kernel)
and `tanh_formula` (the explicit tanh formula of `gelu_new`, which rounds differently from the
kernel, so it is kept apart for bit-exact parity).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError


class GELU(nn.Module):
    def __init__(self, form: str = "exact"):
        super().__init__()
        if form not in ("exact", "tanh", "tanh_formula", "erf_formula"):
            raise ValueError(f"unknown GELU form {form!r}")
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "exact":
            return F.gelu(x)
        if self.form == "tanh":
            return F.gelu(x, approximate="tanh")
        if self.form == "erf_formula":
            return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    def extra_repr(self) -> str:
        return self.form


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class FastGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": lambda: GELU("exact"),
    "gelu_python": lambda: GELU("erf_formula"),
    "gelu_new": lambda: GELU("tanh_formula"),
    "gelu_pytorch_tanh": lambda: GELU("tanh"),
    "gelu_python_tanh": lambda: GELU("tanh_formula"),
    "gelu_fast": FastGELU,
    "quick_gelu": QuickGELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "linear": nn.Identity,
}


def activation(name: str) -> nn.Module:
    """The module for an HF `hidden_act` string; an unknown string names the ones supported."""
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ConfigError(f"hidden_act {name!r} is not supported; choose one of: {', '.join(sorted(_ACTIVATIONS))}") from None
    except TypeError:
        raise ConfigError(f"hidden_act must be a string, got {type(name).__name__}") from None
