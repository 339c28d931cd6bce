"""FP8 training linears: forward and backward equal a float64 computation of the same quantization within
float32 rounding, on the emulated path and through torch._scaled_mm (which this torch runs on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.hub.fp8 import dequantize, quantize
from kiln.models.common.fp8_train import Fp8TrainLinear, scaled_mm_works, swap_fp8_linears

EPS = 2.0**-24


def _within_fp32_rounding(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, extra: torch.Tensor | None = None):
    """|got - a b| <= 2 K eps |a| |b| (float32 accumulation of K products), a, b float64."""
    want = a @ b + (extra if extra is not None else 0)
    bound = 2 * a.shape[-1] * EPS * (a.abs() @ b.abs()) + 1e-30
    assert ((got.double() - want).abs() <= bound).all(), float(((got.double() - want).abs() / bound).max())


def _layer(use_scaled_mm, bias=True):
    torch.manual_seed(0)
    layer = nn.Linear(200, 150, bias=bias)
    swap_fp8_linears(nn.ModuleList([layer]), use_scaled_mm=use_scaled_mm)
    assert isinstance(layer, Fp8TrainLinear)
    return layer


@pytest.mark.parametrize("use_scaled_mm", [False, True])
def test_forward_and_backward_equal_float64_of_the_same_quantization(use_scaled_mm):
    if use_scaled_mm:
        assert scaled_mm_works("cpu")  # torch 2.13 runs _scaled_mm on CPU; the test must not pass by skipping
    layer = _layer(use_scaled_mm)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 200, generator=g) * torch.logspace(-2, 1, 200)).requires_grad_()
    y = layer(x)
    dy = torch.randn(3, 7, 150, generator=g)
    y.backward(dy)

    xq, xs = quantize(x.detach().reshape(21, 200), (1, 128))
    wq, ws = quantize(layer.weight.detach(), (128, 128))
    xd, wd = dequantize(xq, xs, (1, 128)).double(), dequantize(wq, ws, (128, 128)).double()
    _within_fp32_rounding(y.reshape(21, 150), xd, wd.t(), layer.bias.double())
    gq, gs = quantize(dy.reshape(21, 150), (1, 128))
    _within_fp32_rounding(x.grad.reshape(21, 200), dequantize(gq, gs, (1, 128)).double(), wd)
    _within_fp32_rounding(layer.weight.grad, dy.reshape(21, 150).double().t(), x.detach().reshape(21, 200).double())
    torch.testing.assert_close(layer.bias.grad.double(), dy.double().sum((0, 1)), rtol=1e-6, atol=21 * EPS * 8)
    # the control: FP8 is not the float32 product (so the comparisons above can fail)
    assert (y - nn.functional.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3


def test_scaled_mm_path_equals_the_emulation():
    a, b = _layer(True), _layer(False)
    x = torch.randn(4, 300 // 3, 200, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ga = torch.autograd.grad(ya.sum(), (x, a.weight))
    gb = torch.autograd.grad(yb.sum(), (x, b.weight))
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_swap_keeps_names_and_skips_special_linears():
    from kiln.models.common.fp8 import FP8Linear

    blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), FP8Linear(8, 8, False, (128, 128)))])
    before = list(blocks.state_dict())
    assert swap_fp8_linears(blocks) == ["0.0"]
    assert list(blocks.state_dict()) == before and type(blocks[0][1]) is FP8Linear
