"""The fast path of the float32 LoRA update over a bf16 base (QLoRA on CPU) as fused C kernels.

The exact path (kiln/models/common/qlora.py) computes what PEFT computes over bitsandbytes' Linear4bit, in torch:

    y += bf16(B(A(float32(x))) * s)        x, y bf16 (tokens, features); A (r, in), B (out, r) float32

and its backward, which goes through float32 copies of every (tokens, features) tensor: x, the update, the
output's gradient. On CPU those copies and the skinny float32 matmuls over them cost more than the bf16
base matmul's share of the step. Here each pass reads the bf16 activations once and writes bf16 once:

- `forward`: per block of rows, x to float32 in a small buffer, down = x A^T (float32, kept for backward),
  the update down B^T in registers, rounded to bf16 and added to y in place (PEFT's two roundings);
- `backward`: from the output's gradient g (bf16): the gradient of down (g B) and of B (g^T down) in one pass
  over g; from there the gradient of A (gdown^T x) and of x (gdown A, rounded to bf16) in one pass over x.

Same products as the exact path, summed in another order (AVX-512 lanes, fused multiply-add): within float32
rounding of it before the same bf16 roundings, so the fast path of `kiln train` (`train.exact = false`) takes
it; `exact = true` and every parity test keep the torch path. Rows split over torch's thread count; each
thread sums its own copy of the adapters' gradients, added together afterwards.

The C source is csrc/lora_update.c, bound as two torch.library ops: `kiln::lora_forward` (writes y in place,
returns down) and `kiln::lora_backward` (returns the gradients; one not asked for is an empty tensor, which
`backward` gives as None). Their checks (kiln.kernels.checks) run before the C code sees a pointer, and their
fake implementations run the same checks and give the outputs' shapes, so torch.compile traces through them.
`runs` says whether the kernels take the operands (a compiled library: kiln.kernels.build; CPU, bf16
activations, float32 adapters); where not, the caller takes the torch path. The vector code needs AVX-512
(F, BW, VL); a build without it runs the plain C loops.
"""

from __future__ import annotations

import ctypes

import torch

from kiln.kernels import build, checks
from kiln.kernels.scratch import scratch

FORWARD, BACKWARD = "kiln::lora_forward", "kiln::lora_backward"
# torch.library's define / impl rather than custom_op: 3-12 us a call against custom_op's 80-300 us for an op
# that writes an input (kiln/kernels/dequant4.py); a gradient not asked for is an empty tensor (an op returns no
# None)
_OPS = torch.library.Library("kiln", "FRAGMENT")  # held by the module: the registrations live as long as it
_OPS.define("lora_forward(Tensor x, Tensor(a!) y, Tensor a, Tensor b, float s1, float s2, bool vector=True) -> Tensor")
_OPS.define("lora_backward(Tensor g, Tensor x, Tensor a, Tensor b, Tensor down, float s1, float s2, bool need_a, "
            "bool need_b, bool need_x, bool vector=True) -> (Tensor, Tensor, Tensor)")
_ROWS_PER_THREAD = 64
BLOCK = 8  # NB in the C source: rows per block, the size of each thread's float32 row buffer


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of csrc/lora_update.c) with its functions' argument types set."""
    if not getattr(lib, "_kiln_typed", False):
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.kiln_lora_fwd.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, f32, f32, i32, i32]
        lib.kiln_lora_bwd_out.argtypes = [p, p, p, p, p, p, i64, i64, i64, f32, f32, i32, i32]
        lib.kiln_lora_bwd_in.argtypes = [p, p, p, p, p, p, i64, i64, i64, i32, i32]
        for f in (lib.kiln_lora_fwd, lib.kiln_lora_bwd_out, lib.kiln_lora_bwd_in):
            f.restype = None
        setattr(lib, "_kiln_typed", True)  # noqa: B010 - an attribute CDLL does not declare
    return lib


def _lib() -> ctypes.CDLL | None:
    lib = build.load("lora_update", build.read_source("lora_update"))
    return typed(lib) if lib is not None else None


def _needed_lib(op: str) -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"{op}: no native library here (KILN_NATIVE=0 or no C compiler; see kiln.kernels.build): "
                           "kiln.models.common.qlora takes the torch path")
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the library builds and loads here (a constant to torch.compile, which does not trace the build)."""
    return _lib() is not None


def _threads(rows: int) -> int:
    return max(1, min(torch.get_num_threads(), rows // _ROWS_PER_THREAD, 16))


def _rows_buffer(threads: int, width: int) -> torch.Tensor:
    """Each thread's float32 copy of a block of rows (the C code allocates nothing): a reused scratch buffer,
    as are the backward's other temporaries (fresh ones at every matmul fragment glibc's heap)."""
    return scratch("lora_native_rows", (threads, BLOCK * width), torch.float32)


def _check_adapters(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """A (r, in) and B (out, r), float32 (the C code reads copies laid out as it needs)."""
    checks.tensor(op, "a", a, torch.float32, 2)
    checks.tensor(op, "b", b, torch.float32, 2)
    checks.same(op, "b", b, 1, "a", a, 0)


def _check_forward(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    checks.tensor(FORWARD, "x", x, torch.bfloat16, 2)
    checks.tensor(FORWARD, "y", y, torch.bfloat16, 2, contiguous=True)  # written in place
    _check_adapters(FORWARD, a, b)
    checks.same(FORWARD, "y", y, 0, "x", x, 0)
    checks.same(FORWARD, "a", a, 1, "x", x, 1)
    checks.same(FORWARD, "b", b, 0, "y", y, 1)


def lora_forward(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s1: float, s2: float,
                 vector: bool = True) -> torch.Tensor:
    """y (rows, out) bf16 += bf16(((x A^T) s1) B^T s2), in place (the sum rounded to bf16); returns down =
    (x A^T) s1 (rows, r) float32, for backward. x (rows, in) bf16; A (r, in), B (out, r) float32."""
    _check_forward(x, y, a, b)
    lib = _needed_lib(FORWARD)
    rows, r = x.shape[0], a.shape[0]
    x, at, bt = x.contiguous(), a.t().contiguous(), b.t().contiguous()
    down = torch.empty(rows, r, dtype=torch.float32)
    n = _threads(rows)
    buf = _rows_buffer(n, x.shape[1])
    lib.kiln_lora_fwd(x.data_ptr(), at.data_ptr(), bt.data_ptr(), down.data_ptr(), y.data_ptr(), buf.data_ptr(),
                      rows, x.shape[1], y.shape[1], r, s1, s2, n, int(vector))
    return down


_OPS.impl("lora_forward", lora_forward, "CPU")


@torch.library.register_fake(FORWARD, lib=_OPS)
def _lora_forward_fake(x, y, a, b, s1, s2, vector=True):
    _check_forward(x, y, a, b)
    return x.new_empty((x.shape[0], a.shape[0]), dtype=torch.float32)


def _check_backward(g: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, down: torch.Tensor) -> None:
    checks.tensor(BACKWARD, "g", g, torch.bfloat16, 2)
    checks.tensor(BACKWARD, "x", x, torch.bfloat16, 2)
    checks.tensor(BACKWARD, "down", down, torch.float32, 2)
    _check_adapters(BACKWARD, a, b)
    checks.same(BACKWARD, "x", x, 0, "g", g, 0)
    checks.same(BACKWARD, "down", down, 0, "g", g, 0)
    checks.same(BACKWARD, "down", down, 1, "a", a, 0)
    checks.same(BACKWARD, "a", a, 1, "x", x, 1)
    checks.same(BACKWARD, "b", b, 0, "g", g, 1)


def _none(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output of a gradient not asked for (an op returns tensors, never None)."""
    return like.new_empty((0,), dtype=dtype)


def lora_backward(g: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, down: torch.Tensor, s1: float,
                  s2: float, need_a: bool, need_b: bool, need_x: bool,
                  vector: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gx (rows, in) bf16, gA (r, in), gB (out, r)) for the output's gradient g (rows, out) bf16: gdown =
    (g s1) B s2, gB = (g s1)^T down, gA = gdown^T x, gx = bf16(gdown A); one not asked for is empty."""
    _check_backward(g, x, a, b, down)
    lib = _needed_lib(BACKWARD)
    rows, r, out, inn = g.shape[0], a.shape[0], b.shape[0], a.shape[1]
    g, x, a, b, down = g.contiguous(), x.contiguous(), a.contiguous(), b.contiguous(), down.contiguous()
    n = _threads(rows)
    gd = scratch("lora_native_gd", (rows, r), torch.float32)
    part_b = scratch("lora_native_gb", (n, out, r), torch.float32).zero_()  # each thread's own sum (C adds into it)
    buf = _rows_buffer(n, max(out, inn))
    lib.kiln_lora_bwd_out(g.data_ptr(), b.data_ptr(), down.data_ptr(), gd.data_ptr(),
                          part_b.data_ptr(), buf.data_ptr(), rows, out, r, s1, s2, n, int(vector))
    gb = part_b.sum(0) if need_b else _none(g, torch.float32)
    if not (need_a or need_x):
        return _none(g, torch.bfloat16), _none(g, torch.float32), gb
    part_a = scratch("lora_native_ga", (n, inn, r), torch.float32).zero_() if need_a else None
    gx = torch.empty(rows, inn, dtype=torch.bfloat16) if need_x else _none(g, torch.bfloat16)
    lib.kiln_lora_bwd_in(x.data_ptr(), a.data_ptr(), gd.data_ptr(), None if part_a is None else part_a.data_ptr(),
                         gx.data_ptr() if need_x else None, buf.data_ptr(), rows, inn, r, n, int(vector))
    return gx, _none(g, torch.float32) if part_a is None else part_a.sum(0).t().contiguous(), gb


_OPS.impl("lora_backward", lora_backward, "CPU")


@torch.library.register_fake(BACKWARD, lib=_OPS)
def _lora_backward_fake(g, x, a, b, down, s1, s2, need_a, need_b, need_x, vector=True):
    _check_backward(g, x, a, b, down)
    rows, r, out, inn = g.shape[0], a.shape[0], b.shape[0], a.shape[1]
    gx = g.new_empty((rows, inn)) if need_x else _none(g, torch.bfloat16)
    ga = g.new_empty((r, inn), dtype=torch.float32) if need_a else _none(g, torch.float32)
    gb = g.new_empty((out, r), dtype=torch.float32) if need_b else _none(g, torch.float32)
    return gx, ga, gb


def runs(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels take these operands (else the caller's torch path runs): CPU, bf16 activations,
    float32 adapters, a contiguous output, and a compiled library. Under torch.compile too: the ops trace (their
    fake implementations), so a compiled fast path computes what the eager one does, bit for bit."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
            and a.dtype == torch.float32 and b.dtype == torch.float32 and y.is_contiguous() and available())


def forward(x2: torch.Tensor, y2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s1: float, s2: float,
            vector: bool = True) -> torch.Tensor:
    """`kiln::lora_forward`: y2 (rows, out) += the update, in place; returns down (rows, r) float32."""
    return torch.ops.kiln.lora_forward(x2, y2, a, b, s1, s2, vector)


def backward(g2: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, down: torch.Tensor, s1: float,
             s2: float, need_a: bool, need_b: bool, need_x: bool, vector: bool = True):
    """`kiln::lora_backward`: (gx (rows, in) bf16 or None, gA (r, in) or None, gB (out, r) or None)."""
    gx, ga, gb = torch.ops.kiln.lora_backward(g2, x2, a, b, down, s1, s2, need_a, need_b, need_x, vector)
    return gx if need_x else None, ga if need_a else None, gb if need_b else None
