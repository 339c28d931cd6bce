"""The fused 4-bit dequantization kernel (NF4 / FP4, bitsandbytes layout) in C: one pass from packed bytes to
bf16 / fp16 / fp32, equal bit for bit to kiln.hub.bnb4's torch path.

Per block it computes the block's absmax in float32 (nested: code8[byte] * nested absmax, then + offset, two
roundings), the 16 products code[i] * absmax in float32, and rounds those once to the output dtype: bf16 by
round-to-nearest-even with every NaN written 0xFFFF (as torch's vectorized float -> bf16 on x86), fp16 as the
x86 conversion instruction (IEEE nearest-even; a NaN stays quiet with the top of its payload). Every value of
the block is then one lookup of its nibble in that 16-entry table (AVX-512: 32 values per permute); the high
nibble of a byte is the first value. No temporaries, nothing allocated.

The C source is csrc/dequant4.c. `dequantize4` returns False where it cannot run (no native library: see
kiln.kernels.build; a tensor not on CPU or not contiguous; an odd blocksize, whose blocks split bytes), and the
caller uses torch. Otherwise it calls the op `kiln::dequant4` (torch.library: `torch.ops.kiln.dequant4`), which
writes `out` in place; its checks (kiln.kernels.checks) run before the C code sees a pointer, and its fake
implementation runs the same checks, so torch.compile traces through it without a graph break.
"""

from __future__ import annotations

import ctypes

import torch

from kiln.kernels import build, checks

OP = "kiln::dequant4"
# torch.library's define / impl rather than custom_op: custom_op's wrapper of an op that writes an input added
# 80-300 us a call here (its ADInplaceOrView kernel fills in the defaults in Python), define / impl 3-12 us; the
# schema says the same (out is written: Tensor(a!)), and torch.compile functionalizes it alike
_OPS = torch.library.Library("kiln", "FRAGMENT")  # held by the module: the registrations live as long as it
_OPS.define("dequant4(Tensor packed, Tensor code, Tensor absmax, Tensor? nested_absmax, Tensor? nested_code, "
            "int blocksize, int nested_blocksize, float offset, Tensor(a!) out, int threads=0, bool vector=True) -> ()")
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# values per thread (up to torch's thread count): 6144 x 2048 took 2.2-3.2 ms on one thread and no less on two
# here (2 cores, shared, where a second thread that waits for a busy core made it up to 2.5x slower)
_PER_THREAD = 1 << 23


def _lib() -> ctypes.CDLL | None:
    lib = build.load("dequant4", build.read_source("dequant4"))
    if lib is not None and not getattr(lib, "_kiln_typed", False):  # argument types set once per library
        f = lib.kiln_dequant4
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        f.argtypes = [p, i64, i64, p, p, p, p, p, i64, ctypes.c_float, p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        f.restype = ctypes.c_int
        setattr(lib, "_kiln_typed", True)  # noqa: B010 - an attribute CDLL does not declare
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the library builds and loads here (a constant to torch.compile, which does not trace the build)."""
    return _lib() is not None


def _check(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, nested_absmax: torch.Tensor | None,
           nested_code: torch.Tensor | None, blocksize: int, nested_blocksize: int, out: torch.Tensor) -> None:
    """Every size the C loops walk, checked against `out` (n values in blocks of `blocksize`)."""
    checks.tensor(OP, "out", out, tuple(_KINDS), None, contiguous=True)
    n, where = out.numel(), f"for out {tuple(out.shape)}"
    if blocksize <= 0 or blocksize % 2:
        raise ValueError(f"{OP}: blocksize {blocksize} must be even and positive (an odd block splits a byte; "
                         "kiln.hub.bnb4.dequantize's torch path takes it)")
    checks.tensor(OP, "packed", packed, torch.uint8, None, contiguous=True)
    checks.count(OP, "packed", packed, (n + 1) // 2, f"bytes (two 4-bit values each) {where}")
    checks.tensor(OP, "code", code, torch.float32, None, contiguous=True)
    checks.count(OP, "code", code, 16, "entries of a 4-bit code")
    if (nested_absmax is None) != (nested_code is None):
        raise ValueError(f"{OP}: nested_absmax and nested_code come together (double quantization) or not at all")
    checks.tensor(OP, "absmax", absmax, torch.float32 if nested_absmax is None else torch.uint8, None, contiguous=True)
    checks.count(OP, "absmax", absmax, -(-n // blocksize), f"block scales (blocks of {blocksize}) {where}")
    if nested_absmax is not None and nested_code is not None:
        checks.tensor(OP, "nested_code", nested_code, torch.float32, None, contiguous=True)
        checks.count(OP, "nested_code", nested_code, 256, "entries of the 8-bit code of absmax")
        checks.tensor(OP, "nested_absmax", nested_absmax, torch.float32, None, contiguous=True)
        if nested_blocksize <= 0 or nested_absmax.numel() < -(-absmax.numel() // nested_blocksize):
            raise ValueError(f"{OP}: nested_absmax {tuple(nested_absmax.shape)} must hold one scale per "
                             f"{nested_blocksize} of absmax {tuple(absmax.shape)}'s bytes (nested_blocksize "
                             f"{nested_blocksize} must be positive)")


def dequant4(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, nested_absmax: torch.Tensor | None,
             nested_code: torch.Tensor | None, blocksize: int, nested_blocksize: int, offset: float,
             out: torch.Tensor, threads: int = 0, vector: bool = True) -> None:
    """Write out.numel() dequantized values into `out` (contiguous float32 / bf16 / fp16). `absmax` is float32
    per block, or uint8 with `nested_absmax` and `nested_code` (double quantization, + `offset`). `threads` 0:
    one per 8M values up to torch's thread count; `vector=False` takes the plain C loop (the one machines without
    AVX-512 run), for tests."""
    _check(packed, code, absmax, nested_absmax, nested_code, blocksize, nested_blocksize, out)
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"{OP}: no native library here (KILN_NATIVE=0 or no C compiler; see kiln.kernels.build): "
                           "kiln.hub.bnb4.dequantize takes the torch path")
    n, nested = out.numel(), nested_absmax is not None
    if threads <= 0:
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
    def ptr(t: torch.Tensor | None) -> int | None:
        return t.data_ptr() if t is not None else None

    rc = lib.kiln_dequant4(packed.data_ptr(), n, blocksize, code.data_ptr(),
                           None if nested else absmax.data_ptr(), absmax.data_ptr() if nested else None,
                           ptr(nested_code), ptr(nested_absmax), nested_blocksize if nested else 0,
                           float(offset) if nested else 0.0, out.data_ptr(), _KINDS[out.dtype], threads, int(vector))
    if rc != 0:  # the checks above take every argument the C code refuses
        raise RuntimeError(f"{OP}: the C kernel refused its arguments (rc {rc}) after the checks passed")


_OPS.impl("dequant4", dequant4, "CPU")


@torch.library.register_fake(OP, lib=_OPS)
def _dequant4_fake(packed, code, absmax, nested_absmax, nested_code, blocksize, nested_blocksize, offset, out,
                   threads=0, vector=True):
    _check(packed, code, absmax, nested_absmax, nested_code, blocksize, nested_blocksize, out)


def dequantize4(packed: torch.Tensor, n: int, blocksize: int, code: torch.Tensor, absmax: torch.Tensor,
                nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None, nested_blocksize: int,
                offset: float | None, out: torch.Tensor, threads: int | None = None, vector: bool = True) -> bool:
    """Write the `n` dequantized values into `out` with `kiln::dequant4`; False (nothing written) where the kernel
    does not take these operands or there is no library, and the caller takes its torch path (which names a bad
    quant state in its own words)."""
    if out.numel() != n:
        return False
    try:  # the op's own checks: an operand it does not take (another device, strides, an odd block) is no error here
        _check(packed, code, absmax, nested_absmax, nested_code, blocksize, nested_blocksize, out)
    except ValueError:
        return False
    if not available():
        return False
    if nested_absmax is None:
        nested_blocksize, offset = 0, 0.0
    elif offset is None:
        return False  # a double-quantized state without its offset: the torch path names it
    torch.ops.kiln.dequant4(packed, code, absmax, nested_absmax, nested_code, blocksize, nested_blocksize,
                            float(offset), out, threads or 0, vector)
    return True
