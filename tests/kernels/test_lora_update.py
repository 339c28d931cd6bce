"""The fused float32 LoRA update kernels (kiln.kernels.lora_update, the ops kiln::lora_forward / lora_backward),
QLoRA's fast path: every output and gradient within float32 rounding of a float64 reference of the same products
(and, for the bf16 outputs, within the bf16 roundings the exact path makes), on the AVX-512 path and the plain C
loop, for shapes whose rows, features and rank are not multiples of the kernels' blocks; the LoRA layer takes
them only on the fast path.

Bounds: a float32 sum of n products, in any order and with fused multiply-adds, is within (n + 2) 2^-24 of the
sum of the products' magnitudes (the usual gamma_n bound, with headroom for the final scaling); a value rounded
to bf16 moves by at most half a bf16 unit, 2^-8 of its magnitude."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import pytest
import torch
from torch import nn

from kiln.kernels import build, lora_update
from kiln.models.common.fast import fast_state, set_fast
from kiln.models.common.lora import LoraLinear
from tests.models.test_quant4_matmul import _linear4

EPS32 = 2.0 ** -24

needs_kernel = pytest.mark.skipif(build.load("lora_update", build.read_source("lora_update")) is None,
                                  reason="no C compiler here: the fast path falls back to torch (tested below)")


def _operands(rows, inn, out, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inn, generator=g).bfloat16()
    a = torch.randn(r, inn, generator=g) * 0.1
    b = torch.randn(out, r, generator=g) * 0.1
    y = torch.randn(rows, out, generator=g).bfloat16()
    grad = torch.randn(rows, out, generator=g).bfloat16()
    return x, a, b, y, grad


def _gamma(n):
    return (n + 2) * EPS32


SHAPES = [(37, 50, 70, 5), (19, 96, 160, 16), (9, 33, 17, 20)]  # tails in every dimension; r over one vector


@needs_kernel
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("rows, inn, out, r", SHAPES)
@pytest.mark.parametrize("s1, s2", [(2.0, 1.0), (1.0, 1.5)])  # the scaling on (T, r) (a power of two) or (T, out)
@pytest.mark.parametrize("threads", [1, 3])  # rows split over threads, each with its own adapter gradients
def test_kernels_within_float32_rounding_of_float64(monkeypatch, vector, rows, inn, out, r, s1, s2, threads):
    monkeypatch.setattr(lora_update, "_threads", lambda rows: threads)
    _check(vector, rows, inn, out, r, s1, s2)


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for an x86-64 CPU without AVX-512")
def test_a_build_without_avx512_runs_the_plain_loops(monkeypatch, tmp_path):
    """The vector code is behind AVX-512 F/BW/VL: a build for a CPU without it compiles and gives the same bounds."""
    src, lib = tmp_path / "k.c", tmp_path / "k.so"
    src.write_text(build.read_source("lora_update"))
    cc = build._compiler()
    run = subprocess.run([*cc, *build.FLAGS, "-march=x86-64-v3", "-o", str(lib), str(src)], capture_output=True,
                         text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    plain = lora_update.typed(ctypes.CDLL(str(lib)))
    monkeypatch.setattr(lora_update, "_lib", lambda: plain)
    for shape in SHAPES:
        _check(True, *shape, 2.0, 1.0)  # vector=True asks for lanes the build does not have: the plain loops


def _check(vector, rows, inn, out, r, s1, s2):
    x, a, b, y, grad = _operands(rows, inn, out, r)
    x64, a64, b64, g64 = x.double(), a.double(), b.double(), grad.double()
    y2 = y.clone()
    down = lora_update.forward(x, y2, a, b, s1, s2, vector=vector)

    want_down = (x64 @ a64.t()) * s1
    assert (down.double() - want_down).abs().le(_gamma(inn) * (x64.abs() @ a64.abs().t()) * s1).all()
    # the update from the kernel's own down, in float64: rounding it to bf16 and adding to y gives the exact
    # path's value up to one bf16 unit of the update (a rounding that lands on the other side) and of the sum
    up64 = (down.double() @ b64.t()) * s2
    err_up = _gamma(r) * (down.double().abs() @ b64.abs().t()) * s2
    want_y = y.double() + up64
    assert (y2.double() - want_y).abs().le(2.0 ** -8 * (want_y.abs() + up64.abs()) * 1.01 + err_up).all()

    for need in [(True, True, True), (False, True, False), (True, False, True)]:  # (a, b, x)
        sg, sd = (1.0, s1) if s1 != 1.0 else (s2, 1.0)  # the gradient's scale: on (T, out) or on (T, r)
        gx, ga, gb = lora_update.backward(grad, x, a, b, down, sg, sd, *need, vector=vector)
        gs = g64 * sg
        gd = (gs @ b64) * sd
        bound_gd = _gamma(out) * (gs.abs() @ b64.abs()) * sd
        if need[1]:
            want = gs.t() @ down.double()
            assert gb.shape == b.shape and (gb.double() - want).abs().le(_gamma(rows) * (gs.abs().t() @ down.double().abs())).all()
        else:
            assert gb is None
        if need[0]:  # from the kernel's gd: within its bound of gd, then float32 over the rows
            want = gd.t() @ x64
            bound = (bound_gd.t() @ x64.abs()) + _gamma(rows) * ((gd.abs() + bound_gd).t() @ x64.abs())
            assert ga.shape == a.shape and (ga.double() - want).abs().le(bound).all()
        else:
            assert ga is None
        if need[2]:
            want = gd @ a64
            bound = bound_gd @ a64.abs() + _gamma(r) * ((gd.abs() + bound_gd) @ a64.abs())
            assert gx.dtype == torch.bfloat16 and (gx.double() - want).abs().le(2.0 ** -8 * (want.abs() + bound) * 1.01 + bound).all()
        else:
            assert gx is None


def _layer(scaling):
    """A LoRA layer over a 4-bit base with a nonzero update, and a function that runs it forward and backward on
    fixed inputs: [output, grad of x, grad of A, grad of B]."""
    torch.manual_seed(0)
    m = LoraLinear(_linear4((96, 128)), r=8, alpha=16, dropout=0.0, scaling=scaling)
    nn.init.normal_(m.lora_B.weight, std=0.1)
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 7, 96, dtype=torch.bfloat16)

    def run():
        x.grad = m.lora_A.weight.grad = m.lora_B.weight.grad = None
        y = m(x)
        y.backward(grad)
        return [y.detach(), x.grad, m.lora_A.weight.grad, m.lora_B.weight.grad]

    return m, run


@needs_kernel
@pytest.mark.parametrize("scaling", [2.0, 1.5])
def test_lora_layer_takes_the_kernels_only_on_the_fast_path(monkeypatch, scaling):
    """Which path runs; the values' bounds are the kernel test's. Here each fast value is within 2^-6 of the
    largest of its tensor from the exact path's (a few bf16 units): a missing term or a wrong scale moves
    values by their own size."""
    m, run = _layer(scaling)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(lora_update, name)
        monkeypatch.setattr(lora_update, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    exact = run()
    assert calls == [] and fast_state(m) == {"": False}
    set_fast(m, True)
    fast = run()
    assert calls == ["forward", "backward"]
    y_e, y_f = exact[0].double(), fast[0].double()
    assert (y_e - y_f).abs().le(2.0 ** -6 * y_e.abs() + 1e-6).all()  # a bf16 unit each way, with headroom
    for e, f in zip(exact[1:], fast[1:]):
        assert e.dtype == f.dtype and e.shape == f.shape
        assert (e.double() - f.double()).abs().max() <= 2.0 ** -6 * e.double().abs().max()


def test_without_the_library_the_fast_path_is_the_exact_one(monkeypatch):
    """KILN_NATIVE=0 (or no compiler): `runs` says no and the fast path computes the exact one, bit for bit."""
    m, run = _layer(2.0)
    exact = run()
    monkeypatch.setenv("KILN_NATIVE", "0")
    build.forget("lora_update")
    try:
        set_fast(m, True)
        assert not lora_update.runs(exact[0], exact[0], m.lora_A.weight, m.lora_B.weight)
        assert all(torch.equal(e, g) for e, g in zip(exact, run()))
    finally:
        monkeypatch.delenv("KILN_NATIVE")
        build.forget("lora_update")
