"""FP8 training linears (DeepSeek-V3's recipe): fine-grained scaling, float32 master weights.

Forward: activations are quantized per 1x128 tile (one scale per row and 128 input features), the
weight per 128x128 block, both float8_e4m3fn with scale = 448 / amax; y = X W^T accumulates in
float32, through `torch._scaled_mm` (one row-wise scaled product per 128-wide slice of the
contraction) where this device runs it, else by an exact emulation (dequantize, float32 matmul).
Backward: dX = dY W with dY quantized per 1x128 tile and W in the forward's blocks (the same FP8
scheme); the weight gradient dW = dY^T X stays in the compute precision (unquantized dY and X), as
DeepSeek keeps its wgrad accumulation wide and for the stability of small models.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from kiln.hub.fp8 import FP8, dequantize, quantize

TILE = 128
RECIPES = ("blockwise", "torchao")


@functools.cache
def scaled_mm_works(device_type: str) -> bool:
    """Whether `torch._scaled_mm` runs a row-wise scaled float32-output product on this kind of device."""
    try:
        a = torch.ones(16, 32, device=device_type).to(FP8)
        out = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device_type),
                               scale_b=torch.full((1, 16), 2.0, device=device_type), out_dtype=torch.float32)
        return bool(torch.all(out == 64.0))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def _expand_block_rows(ws: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Per-row scales of a (n, K) weight for each 128-wide column slice: (K/128, n)."""
    return ws.t().repeat_interleave(block, dim=1)[:, :n].contiguous()


def fp8_matmul(aq: torch.Tensor, a_s: torch.Tensor, bq: torch.Tensor, b_s: torch.Tensor, block: int,
               use_scaled_mm: bool) -> torch.Tensor:
    """A (M, K) tile-scaled (scales (M, K/t)) times B (N, K) block-scaled (scales (N/b, K/b)) transposed: (M, N) float32."""
    if not use_scaled_mm:
        return dequantize(aq, a_s, (1, block)) @ dequantize(bq, b_s, (block, block)).t()
    n, k = bq.shape
    b_rows = _expand_block_rows(b_s.float(), n, block)  # (K/b, N)
    out = None
    for j, start in enumerate(range(0, k, block)):
        part = torch._scaled_mm(aq[:, start:start + block].contiguous(), bq[:, start:start + block].contiguous().t(),
                                scale_a=a_s[:, j:j + 1].float().contiguous(), scale_b=b_rows[j:j + 1],
                                out_dtype=torch.float32)
        out = part if out is None else out + part
    if out is None:
        raise ValueError(f"fp8_matmul: B {tuple(bq.shape)} has no columns (K = 0)")
    return out


class _Fp8MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, block, use_scaled_mm):
        x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
        xq, xs = quantize(x2, (1, block))
        wq, ws = quantize(weight, (block, block))
        y = fp8_matmul(xq, xs, wq, ws, block, use_scaled_mm)  # (M, N) float32
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, wq, ws)
        ctx.block, ctx.use_scaled_mm, ctx.has_bias, ctx.w_dtype = block, use_scaled_mm, bias is not None, weight.dtype
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return y.reshape(*x.shape[:-1], -1).to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, wq, ws = ctx.saved_tensors
        block = ctx.block
        g2 = grad.reshape(-1, grad.shape[-1]).float()  # (M, N)
        gq, gs = quantize(g2, (1, block))
        # dX = dY W: contract over N; W^T (K, N) in the same 128x128 blocks (transposed grid)
        gx = fp8_matmul(gq, gs, wq.t().contiguous(), ws.t().contiguous(), block, ctx.use_scaled_mm)
        gw = g2.t() @ x.reshape(-1, x.shape[-1]).float()  # (N, K), compute precision
        gb = g2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return gx.reshape(x.shape).to(x.dtype), gw.to(ctx.w_dtype), gb, None, None


class Fp8TrainLinear(nn.Linear):
    """A Linear (float32 master `weight`, same names and init) whose matmuls run in block-scaled FP8."""

    block: int = TILE
    use_scaled_mm: bool | None = None  # None: `_scaled_mm` where `scaled_mm_works`, else the emulation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = self.use_scaled_mm if self.use_scaled_mm is not None else scaled_mm_works(x.device.type)
        bias = self.bias
        return _Fp8MatmulFn.apply(x, self.weight, bias, self.block, use)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 1x{self.block} activations, {self.block}x{self.block} weights"


def swap_fp8_linears(blocks: nn.Module, use_scaled_mm: bool | None = None, block: int = TILE) -> list[str]:
    """Make every plain nn.Linear under `blocks` an Fp8TrainLinear in place (parameters kept); returns their names."""
    names = []
    for name, module in blocks.named_modules():
        if type(module) is nn.Linear:  # LoRA, FP8-checkpoint and other special Linears keep their own forward
            module.__class__ = Fp8TrainLinear
            fp8 = cast(Fp8TrainLinear, module)  # its class was switched on the line above
            fp8.use_scaled_mm, fp8.block = use_scaled_mm, block
            names.append(name)
    return names


def swap_torchao(blocks: nn.Module) -> list[str]:
    """torchao's float8 training (`convert_to_float8_training`) on the blocks' Linears, where torchao installs."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        from kiln.errors import ConfigError

        raise ConfigError("fp8_recipe 'torchao' needs torchao (pip install torchao); the 'blockwise' recipe "
                          "needs nothing beyond torch") from None
    names = [n for n, m in blocks.named_modules() if type(m) is nn.Linear]
    convert_to_float8_training(blocks)
    return names
