"""The float32 adapter update of a LoRA layer over a 4-bit base on CPU, as PEFT computes it over bitsandbytes'
Linear4bit:

    y = x W^T (+ b) + round(B(A(x32)) * scaling)     x in the base's compute dtype, A and B float32

the base in the compute dtype (quant4.linear4: W dequantized once per forward, and once per backward only for
a gradient of x), the update in float32 rounded to the compute dtype and added into the base's output in
place. The Function keeps for backward only x as it came, the adapters and the (tokens, r) product: plain
autograd kept a float32 copy of every adapted Linear's input (q, k and v each their own), more than the
activations the frozen base keeps; its float32 and rounded (tokens, features) temporaries live in reused
scratch buffers (quant4.scratch): fresh ones at every matmul left glibc's heap fragmented. A scaling that is a
power of two (alpha / r = 2, PEFT's usual) multiplies the (tokens, r) product instead of the (tokens, out)
one: exact, so the values are the plain form's bit for bit either way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.models.common.quant4 import linear4, scratch


def _power_of_two(s: float) -> bool:
    return s > 0 and math.frexp(s)[0] == 0.5


class QLoraUpdateFn(torch.autograd.Function):
    """(y, x, A, B, scaling) -> y + round(B(A(x32)) * scaling), added into y (the base's output) in place."""

    @staticmethod
    def forward(ctx, y, x, a, b, scaling):
        x2 = x.reshape(-1, x.shape[-1])  # (T, in)
        xs = scratch("lora_x", x2.shape, a.dtype)
        xs.copy_(x2)
        down = xs @ a.t()  # (T, r), as F.linear computes it
        exact = _power_of_two(scaling)
        if exact:  # (down s) B^T == (down B^T) s bit for bit
            down.mul_(scaling)
        up = scratch("lora_up", (x2.shape[0], b.shape[0]), b.dtype)
        torch.mm(down, b.t(), out=up)
        if not exact:
            up.mul_(scaling)
        rounded = scratch("lora_up_x", up.shape, y.dtype)
        rounded.copy_(up)
        y.add_(rounded.view(y.shape))  # the update rounded to the base's dtype, then added (PEFT's order)
        ctx.mark_dirty(y)
        ctx.save_for_backward(x, a, b, down)
        ctx.scaling, ctx.exact = scaling, exact
        return y

    @staticmethod
    def backward(ctx, grad):
        x, a, b, down = ctx.saved_tensors  # down is (x A^T) s when the scaling is exact
        need_x, need_a, need_b = ctx.needs_input_grad[1:4]
        g2 = grad.reshape(-1, grad.shape[-1])  # (T, out)
        g = scratch("lora_up", g2.shape, b.dtype)
        g.copy_(g2)
        if not ctx.exact:
            g.mul_(ctx.scaling)
        gb = g.t() @ down if need_b else None  # (out, r)
        gdown = g @ b  # (T, r)
        if ctx.exact:
            gdown.mul_(ctx.scaling)
        x2 = x.reshape(-1, x.shape[-1])
        xs = scratch("lora_x", x2.shape, a.dtype)
        ga = gx = None
        if need_a:
            xs.copy_(x2)
            ga = gdown.t() @ xs  # (r, in)
        if need_x:  # its own tensor: autograd adds it to the base's gradient of x, as for any two uses of x
            torch.mm(gdown, a, out=xs)
            gx = xs.to(x.dtype).view(x.shape)
        return grad, gx, ga, gb, None


def qlora_linear(x: torch.Tensor, module: nn.Module, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The LoRA layer `module` over its 4-bit base for x in the base's compute dtype (see the module docstring)."""
    y = linear4(x, module)
    if y._base is not None:  # a biased base's output is a view of its addmm, which autograd lets no one modify
        y = y.clone()
    return QLoraUpdateFn.apply(y, x, a, b, scaling)
