"""The kernels as torch.library ops: their checks name the tensor and both shapes (before C sees a pointer, and
under torch.compile's fake tensors too), their fake implementations give the real outputs' shapes and dtypes
(torch.library.opcheck), torch.compile(fullgraph=True) traces a module calling them without a graph break and
computes the eager values bit for bit, and the C sources ship as package data.

torch.compile here uses backend="aot_eager" (dynamo's graph capture and AOT autograd's functionalization of the
in-place ops, no code generation): inductor's C++ builds took 20 s to 3 min a module on this 2-core machine; one
inductor run is marked slow."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.hub import bnb4
from kiln.kernels import build, dequant4, lora_update
from kiln.models.common.fast import set_fast
from kiln.models.common.lora import LoraLinear
from tests.models.test_quant4_matmul import _linear4

ROOT = Path(__file__).resolve().parents[2]
needs_dequant = pytest.mark.skipif(not dequant4.available(), reason="no C compiler here: bnb4 takes the torch path")
needs_lora = pytest.mark.skipif(not lora_update.available(), reason="no C compiler here: qlora takes the torch path")


def _quant(shape=(6, 64), double=True):
    return bnb4.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), "nf4", 64, double)


def _dequant_args(q, out):
    return [q.packed, q.code, q.absmax, q.nested_absmax, q.nested_code, q.blocksize, q.nested_blocksize,
            q.offset or 0.0, out]


def _lora_args(rows=9, inn=24, out=20, r=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, inn, generator=g).bfloat16()
    y = torch.randn(rows, out, generator=g).bfloat16()
    a, b = torch.randn(r, inn, generator=g) * 0.1, torch.randn(out, r, generator=g) * 0.1
    return x, y, a, b


# ---- the checks: each bad operand names itself, and a mismatch both tensors' shapes --------------------------

def _bad_dequant_cases():
    """(the message's parts, the operands changed)"""
    q = _quant()
    yield ("out (6, 64) must be torch.float32 or torch.bfloat16 or torch.float16, not torch.int32",), \
        {"out": torch.empty(6, 64, dtype=torch.int32)}
    yield ("out (6, 64) must be contiguous", "not strides (1, 6)"), {"out": torch.empty(64, 6).t().bfloat16()}
    yield ("packed (191, 1) holds 191 values, not the 192 bytes (two 4-bit values each) for out (6, 64)",), \
        {"packed": q.packed[:-1]}
    yield ("absmax (5,) holds 5 values, not the 6 block scales (blocks of 64) for out (6, 64)",), \
        {"absmax": q.absmax[:5]}
    yield ("absmax (6,) must be torch.uint8, not torch.float32",), {"absmax": q.absmax.float()}
    yield ("code (15,) holds 15 values, not the 16 entries",), {"code": q.code[:15]}
    yield ("blocksize 63 must be even",), {"blocksize": 63}
    yield ("nested_absmax and nested_code come together",), {"nested_code": None}
    yield ("out (6, 64) must be on the CPU, not meta",), {"out": torch.empty(6, 64, device="meta")}


@pytest.mark.parametrize("parts, change", list(_bad_dequant_cases()))
def test_dequant4_checks_name_the_tensor_and_its_shapes(parts, change):
    q = _quant()
    names = ["packed", "code", "absmax", "nested_absmax", "nested_code", "blocksize", "nested_blocksize", "offset",
             "out"]
    args = dict(zip(names, _dequant_args(q, torch.empty(6, 64, dtype=torch.bfloat16))))
    args.update(change)
    with pytest.raises(ValueError) as raised:
        torch.ops.kiln.dequant4(*args.values())
    assert str(raised.value).startswith("kiln::dequant4: ")
    assert all(part in str(raised.value) for part in parts), (str(raised.value), parts)


def _bad_lora_forward_cases():
    x, y, a, b = _lora_args()
    yield r"y \(8, 20\) and x \(9, 24\) do not fit: y's size 0 \(8\) must equal x's size 0 \(9\)", (x, y[:8], a, b)
    yield r"a \(4, 23\) and x \(9, 24\) do not fit: a's size 1 \(23\) must equal x's size 1 \(24\)", \
        (x, y, a[:, :23], b)
    yield r"b \(20, 3\) and a \(4, 24\) do not fit: b's size 1 \(3\) must equal a's size 0 \(4\)", (x, y, a, b[:, :3])
    yield r"b \(19, 4\) and y \(9, 20\) do not fit", (x, y, a, b[:19])
    yield r"y \(9, 20\) must be contiguous \(the kernel walks or writes it as one block\), not strides \(1, 9\)", \
        (x, y.t().contiguous().t(), a, b)
    yield r"x \(9, 24\) must be torch.bfloat16, not torch.float32", (x.float(), y, a, b)
    yield r"a \(4, 24\) must be torch.float32, not torch.bfloat16", (x, y, a.bfloat16(), b)
    yield r"x must have 2 dimension\(s\), not shape \(1, 9, 24\)", (x[None], y, a, b)


@pytest.mark.parametrize("message, args", list(_bad_lora_forward_cases()))
def test_lora_forward_checks_name_the_tensor_and_its_shapes(message, args):
    y_before = args[1].clone()
    with pytest.raises(ValueError, match="kiln::lora_forward: " + message):
        torch.ops.kiln.lora_forward(*args, 2.0, 1.0)
    assert torch.equal(args[1], y_before)  # refused before anything was written


def test_lora_backward_checks_name_the_tensor_and_its_shapes():
    x, y, a, b = _lora_args()
    down = torch.zeros(9, 4)
    ok = (y, x, a, b, down)
    for i, bad, message in [(4, torch.zeros(9, 5), r"down \(9, 5\) and a \(4, 24\) do not fit"),
                            (4, torch.zeros(8, 4), r"down \(8, 4\) and g \(9, 20\) do not fit"),
                            (1, x[:7], r"x \(7, 24\) and g \(9, 20\) do not fit"),
                            (0, y.float(), r"g \(9, 20\) must be torch.bfloat16, not torch.float32")]:
        args = list(ok)
        args[i] = bad
        with pytest.raises(ValueError, match="kiln::lora_backward: " + message):
            torch.ops.kiln.lora_backward(*args, 1.0, 2.0, True, True, True)


def test_checks_run_under_fake_tensors_and_fakes_give_the_output_shapes():
    """The fake implementations (what torch.compile traces) run the same checks and give the outputs' shapes and
    dtypes without the library or any data."""
    q = _quant()
    with FakeTensorMode() as mode:
        x, y, a, b = _lora_args(rows=11, inn=24, out=20, r=4)
        down = torch.ops.kiln.lora_forward(x, y, a, b, 2.0, 1.0)
        assert down.shape == (11, 4) and down.dtype == torch.float32
        gx, ga, gb = torch.ops.kiln.lora_backward(y, x, a, b, down, 1.0, 2.0, True, False, True)
        assert (gx.shape, gx.dtype, ga.shape, gb.shape) == ((11, 24), torch.bfloat16, (4, 24), (0,))
        with pytest.raises(ValueError, match=r"y \(10, 20\) and x \(11, 24\) do not fit"):
            torch.ops.kiln.lora_forward(x, y[:10], a, b, 2.0, 1.0)
        out = torch.empty(6, 64, dtype=torch.float16)
        fake_q = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in _dequant_args(q, out)]
        torch.ops.kiln.dequant4(*fake_q)
        fake_q[2] = torch.empty(7, dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"absmax \(7,\) holds 7 values, not the 6 block scales"):
            torch.ops.kiln.dequant4(*fake_q)


def test_without_the_library_the_op_says_so(monkeypatch):
    monkeypatch.setattr(lora_update, "_lib", lambda: None)
    monkeypatch.setattr(dequant4, "_lib", lambda: None)
    x, y, a, b = _lora_args()
    with pytest.raises(RuntimeError, match="kiln::lora_forward: no native library here .*KILN_NATIVE=0"):
        torch.ops.kiln.lora_forward(x, y, a, b, 2.0, 1.0)
    q = _quant()
    with pytest.raises(RuntimeError, match="kiln::dequant4: no native library here"):
        torch.ops.kiln.dequant4(*_dequant_args(q, torch.empty(6, 64)))


# ---- the ops as torch sees them: schema, fakes, functionalization; compile --------------------------------

@needs_dequant
@needs_lora
def test_opcheck_schema_fake_and_aot_dispatch():
    """torch.library.opcheck: the schema declares what each op mutates, the fake implementation's outputs match
    the real ones' metadata, and AOT autograd's functionalization (static and dynamic shapes) gives the same
    values."""
    q = _quant((7, 130))
    torch.library.opcheck(torch.ops.kiln.dequant4.default, _dequant_args(q, torch.empty(7, 130, dtype=torch.bfloat16)))
    torch.library.opcheck(torch.ops.kiln.dequant4.default, _dequant_args(_quant((3, 64), False), torch.empty(3, 64)))
    x, y, a, b = _lora_args()
    torch.library.opcheck(torch.ops.kiln.lora_forward.default, (x, y, a, b, 2.0, 1.0))
    down = torch.randn(9, 4)
    for need in [(True, True, True), (False, True, False)]:
        torch.library.opcheck(torch.ops.kiln.lora_backward.default, (y, x, a, b, down, 1.0, 2.0, *need))


class _Dequant(nn.Module):
    """A tiny module calling kiln::dequant4 (into a fresh buffer) and using the weight."""

    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, x):
        w = torch.empty(self.q.shape, dtype=x.dtype)
        torch.ops.kiln.dequant4(*_dequant_args(self.q, w))
        return x @ w.t()


def _compiled_equal(module, *inputs, backend="aot_eager"):
    torch._dynamo.reset()
    want = module(*inputs)
    got = torch.compile(module, fullgraph=True, backend=backend)(*inputs)  # fullgraph: a graph break raises
    return all(torch.equal(w, g) for w, g in zip(want if isinstance(want, tuple) else (want,),
                                                 got if isinstance(got, tuple) else (got,)))


@needs_dequant
def test_compile_fullgraph_through_dequant4_and_bnb4():
    q = _quant((16, 128))
    x = torch.randn(3, 128).bfloat16()
    assert _compiled_equal(_Dequant(q), x)

    class Bnb4(nn.Module):  # kiln.hub.bnb4.dequantize's own call: the check for the library is a constant
        def forward(self, x):
            return x @ bnb4.dequantize(q, torch.bfloat16).t()

    assert _compiled_equal(Bnb4(), x)


@needs_lora
def test_compile_fullgraph_through_the_lora_ops():
    class Update(nn.Module):
        def forward(self, x, y, a, b):
            y = y.clone()
            down = torch.ops.kiln.lora_forward(x, y, a, b, 2.0, 1.0)
            return (y, down, *torch.ops.kiln.lora_backward(y, x, a, b, down, 1.0, 2.0, True, True, True))

    assert _compiled_equal(Update(), *_lora_args())


@needs_lora
def test_a_compiled_qlora_layer_takes_the_kernels_as_eager_does():
    """QLoRA's fast path (a LoRA layer over a 4-bit base) compiled whole: no graph break (the dequantization and
    the update's forward and backward are ops), and every output and gradient is the eager fast path's, bit
    for bit (before the ops, a compiled layer routed around the kernels and took the exact path)."""
    torch.manual_seed(0)
    m = LoraLinear(_linear4((96, 128)), r=8, alpha=16, dropout=0.0, scaling=2.0)
    nn.init.normal_(m.lora_B.weight, std=0.1)
    set_fast(m, True)
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 7, 96, dtype=torch.bfloat16)

    def run(f):
        x.grad = m.lora_A.weight.grad = m.lora_B.weight.grad = None
        y = f(x)
        y.backward(grad)
        return [y.detach(), x.grad, m.lora_A.weight.grad, m.lora_B.weight.grad]

    want = run(m)
    torch._dynamo.reset()
    assert torch._dynamo.explain(m)(x).graph_break_count == 0
    torch._dynamo.reset()
    got = run(torch.compile(m, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(w, g) for w, g in zip(want, got))


@pytest.mark.slow
@needs_dequant
def test_inductor_compiles_a_module_calling_dequant4():
    assert _compiled_equal(_Dequant(_quant((16, 128))), torch.randn(3, 128).bfloat16(), backend="inductor")


# ---- the sources ship with the package ------------------------------------------------------------------

def test_every_c_source_is_package_data():
    """Each csrc/*.c is read by its kernel and matched by pyproject's package-data glob (a wheel carries it)."""
    csrc = sorted(p.name for p in (ROOT / "kiln" / "kernels" / "csrc").iterdir())
    assert csrc == ["dequant4.c", "lora_update.c"]
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kiln.kernels"]
    for name in csrc:
        assert any(Path("csrc", name).match(g) for g in globs), (name, globs)
        assert build.read_source(name.removesuffix(".c")) == (ROOT / "kiln" / "kernels" / "csrc" / name).read_text()
