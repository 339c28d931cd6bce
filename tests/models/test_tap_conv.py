"""The fast causal conv of the Gated DeltaNet (SiLU taps as one autograd node, in place) against
torch's depthwise conv1d, with packed-row restarts, a bias and windows longer than the row."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.hybrid import tap_conv


def _reference(x, weight, bias, resets):
    """conv1d per packed sample (channel-major, left zero padding), then SiLU."""
    B, T, C = x.shape
    K = weight.shape[-1]
    out = torch.empty_like(x)
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if resets is not None and resets[b, t]] + [T]
        for s, e in itertools.pairwise(starts):
            seg = x[b:b + 1, s:e].transpose(1, 2)
            y = F.conv1d(F.pad(seg, (K - 1, 0)), weight, bias, groups=C)
            out[b, s:e] = F.silu(y)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("T", [9, 2])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_tap_conv_matches_conv1d_and_passes_gradcheck(T, packed, with_bias):
    g = torch.Generator().manual_seed(T)
    f64 = dict(generator=g, dtype=torch.float64)
    B, C, K = 2, 5, 4
    x, weight = torch.randn(B, T, C, **f64), torch.randn(C, 1, K, **f64)
    bias = torch.randn(C, **f64) if with_bias else None
    resets = None
    if packed:
        resets = torch.zeros(B, T, dtype=torch.bool)
        resets[0, T // 2] = True  # row 0: two samples; row 1: one
    torch.testing.assert_close(tap_conv(x, weight, bias, nn.SiLU(), resets), _reference(x, weight, bias, resets))
    inputs = [t.clone().requires_grad_() for t in (x, weight) + ((bias,) if with_bias else ())]
    assert torch.autograd.gradcheck(
        lambda *a: tap_conv(a[0], a[1], a[2] if with_bias else None, nn.SiLU(), resets), inputs)


def test_other_activations_take_the_generic_taps():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 7, 3, generator=g), torch.randn(3, 1, 4, generator=g)
    want = F.gelu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight, groups=3)).transpose(1, 2)
    torch.testing.assert_close(tap_conv(x, weight, None, nn.GELU()), want)
