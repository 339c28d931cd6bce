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

`fast` (the Trainer's fast path, models/common/fast.py) computes the same update and gradients with the fused
kernels of kiln/kernels/lora_update.py, which read each bf16 activation once instead of going through float32 copies:
within float32 rounding of this path, before the same roundings to bf16.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kiln.kernels import lora_update as lora_native
from kiln.kernels.scratch import scratch
from kiln.models.common.quant4 import linear4

if TYPE_CHECKING:  # (it imports this module)
    from kiln.models.common.lora import LoraLinear


def _power_of_two(s: float) -> bool:
    return s > 0 and math.frexp(s)[0] == 0.5


class QLoraUpdateFn(torch.autograd.Function):
    """(y, x, A, B, scaling, fast) -> y + round(B(A(x32)) * scaling), added into y (the base's output) in place."""

    @staticmethod
    def forward(ctx, y, x, a, b, scaling, fast=False):
        x2 = x.reshape(-1, x.shape[-1])  # (T, in)
        exact = _power_of_two(scaling)
        ctx.scaling, ctx.exact = scaling, exact
        ctx.native = fast and lora_native.runs(x, y, a, b)
        if ctx.native:  # the scaling on the (T, r) product when exact, else on the (T, out) one, as below
            down = lora_native.forward(x2, y.view(-1, y.shape[-1]), a, b, *((scaling, 1.0) if exact else (1.0, scaling)))
            ctx.mark_dirty(y)
            ctx.save_for_backward(x, a, b, down)
            return y
        xs = scratch("lora_x", x2.shape, a.dtype)
        xs.copy_(x2)
        down = xs @ a.t()  # (T, r), as F.linear computes it
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
        return y

    @staticmethod
    def backward(ctx, grad):
        x, a, b, down = ctx.saved_tensors  # down is (x A^T) s when the scaling is exact
        need_x, need_a, need_b = ctx.needs_input_grad[1:4]
        g2 = grad.reshape(-1, grad.shape[-1])  # (T, out)
        if ctx.native and grad.dtype == torch.bfloat16:
            scales = (1.0, ctx.scaling) if ctx.exact else (ctx.scaling, 1.0)
            gx, ga, gb = lora_native.backward(g2, x.reshape(-1, x.shape[-1]), a, b, down, *scales, need_a, need_b, need_x)
            return grad, gx.view(x.shape) if gx is not None else None, ga, gb, None, None
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
        return grad, gx, ga, gb, None, None


def qlora_linear(x: torch.Tensor, module: LoraLinear, a: torch.Tensor, b: torch.Tensor, scaling: float,
                 fast: bool = False) -> torch.Tensor:
    """The LoRA layer `module` over its 4-bit base for x in the base's compute dtype (see the module docstring);
    `fast` takes the fused kernels where they run."""
    y = linear4(x, module)
    if y._base is not None:  # a biased base's output is a view of its addmm, which autograd lets no one modify
        y = y.clone()
    return QLoraUpdateFn.apply(y, x, a, b, scaling, fast)
