"""Bounds for the fast-path numerics tests, from an error estimate rather than a fixed number (not a test module).

A fast path and the exact one compute the same sums in another order, each in float32 (or bf16). The
rounding error of one tensor, on these very inputs, is estimated as

    e = max|ref - ref64|  +  sqrt(n) * u * max|ref64|

- max|ref - ref64|: the exact path's own rounding, measured against the same path run in float64. This
  is where a tensor's conditioning shows: a gradient summed over all positions whose terms cancel (the
  Gated DeltaNet's dt_bias and A_log, ~200 u of their largest entry at 2 x 1000 tokens) carries a much
  larger error than its size suggests, and how large depends on the machine's kernels and thread count.
- sqrt(n) * u * max|ref64|: the rounding a sum of n terms gets without cancellation (the probabilistic
  bound, Higham & Mary 2019), u the unit roundoff; a floor for tensors whose measured error happens to
  be zero.

Another order of the same sums has an error of the same size (observed: up to ~2 e), so a fast path is
within ORDER * e of the float64 result and within (1 + ORDER) * e of the float32 reference; the tests
allow HEADROOM (10) times that. A wrong term in a backward is off by orders of magnitude more.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8
ORDER = 2.0      # another summation order's error, in units of the reference's
HEADROOM = 10.0


def rounding_error(ref: torch.Tensor, ref64: torch.Tensor, n: int, u: float = U_FP32) -> float:
    """The estimate e above for one tensor: `ref` the exact path in float32 (or bf16), `ref64` in float64,
    n the length of the longest sum behind it (the batch's tokens for a gradient)."""
    ref, ref64 = ref.detach().double(), ref64.detach().double()
    if ref.shape != ref64.shape:
        raise ValueError(f"reference shapes differ: {tuple(ref.shape)} vs float64 {tuple(ref64.shape)}")
    return float((ref - ref64).abs().max()) + math.sqrt(n) * u * float(ref64.abs().max())


def assert_within(got: torch.Tensor, want: torch.Tensor, e: float, what: str, against_float64: bool = False) -> None:
    """|got - want| <= HEADROOM * (ORDER or 1 + ORDER) * e, `want` the float64 result or the float32 reference."""
    bound = HEADROOM * (ORDER if against_float64 else 1.0 + ORDER) * e
    err = float((got.detach().double() - want.detach().double()).abs().max())
    scale = float(want.detach().abs().max())
    if os.environ.get("KILN_ROUNDING_LOG"):  # `KILN_ROUNDING_LOG=1 pytest -s`: every observed error vs its bound
        print(f"rounding {what}: err {err / max(scale, 1e-300):.2e} bound {bound / max(scale, 1e-300):.2e} "
              f"(relative to max {scale:.3g}; err/bound {err / bound if bound else float(err > 0):.3f}, "
              f"threads {torch.get_num_threads()})")
    assert err <= bound, (f"{what}: max abs diff {err:.3g} > bound {bound:.3g} (= {HEADROOM:g} x the rounding "
                          f"estimate {e:.3g}; max |want| {scale:.3g})")


def assert_all_within(got: dict, ref: dict, ref64: dict, n: int, what: str, against_float64: bool = False) -> None:
    """Each tensor of `got` within the estimate from the exact path in float32 (`ref`) and float64 (`ref64`),
    compared with `ref64` or with `ref`; the three dicts share their names."""
    if not got.keys() == ref.keys() == ref64.keys():
        raise AssertionError(f"{what}: different tensors: {sorted(got.keys() ^ ref.keys())}")
    for name in ref:
        e = rounding_error(ref[name], ref64[name], n)
        assert_within(got[name], ref64[name] if against_float64 else ref[name], e, f"{what}: {name}", against_float64)


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request) -> int:
    """Run a test with 1 and with 2 intra-op threads (another reduction split), restoring the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
