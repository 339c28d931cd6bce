"""The C 4-bit dequantization kernel (kiln.kernels.dequant4, the op kiln::dequant4) against the torch path of
kiln.hub.bnb4 (itself equal to bitsandbytes' dequantize_4bit: tests/models/test_quant4.py): every bit, in both
of its loops (AVX-512 and plain C), one thread or several, with NaN and inf in the absmax; and the fallback to
torch where the kernel cannot be had (KILN_NATIVE=0, no compiler, a compiler that fails), and the cached build
(kiln.kernels.build)."""

from __future__ import annotations

import logging
import subprocess
import threading

import pytest
import torch

from kiln.hub import bnb4
from kiln.kernels import build, dequant4

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SOURCE = build.read_source("dequant4")


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _torch_path(monkeypatch, q, dtype):
    with monkeypatch.context() as m:
        m.setenv("KILN_NATIVE", "0")
        return bnb4.dequantize(q, dtype)


def _native(q, dtype, **kw):
    out = torch.full(q.shape, 7.0, dtype=dtype)  # not 0 or NaN: a value left unwritten shows
    n = out.numel()
    assert dequant4.dequantize4(q.packed, n, q.blocksize, q.code, q.absmax, q.nested_absmax, q.nested_code,
                                q.nested_blocksize, q.offset, out, **kw)
    return out


@pytest.mark.parametrize("quant_type", bnb4.QUANT_TYPES)
def test_native_equals_torch_path_bit_for_bit(monkeypatch, quant_type):
    # sizes: whole blocks, a partial last block, an odd total (half a byte), one value, > 256 blocks (several
    # nested groups and a partial one), 2 threads' worth; scales from 1e-9 (fp16 subnormals and zeros) to 10
    for i, (shape, double) in enumerate([((64, 64), True), ((7, 45), True), ((7, 45), False), ((1,), True),
                                         ((33, 97), False), ((257, 130), True), ((128, 1024), True)]):
        g = torch.Generator().manual_seed(i)
        w = torch.randn(*shape, generator=g) * torch.logspace(-9, 1, shape[-1])
        w.view(-1)[::7] = 0.0
        q = bnb4.quantize(w.to(torch.bfloat16), quant_type, 64, double)
        for dtype in DTYPES:
            ref = _bits(_torch_path(monkeypatch, q, dtype))
            for vector, threads in ((True, 1), (True, 3), (False, 2)):
                got = _bits(_native(q, dtype, threads=threads, vector=vector))
                assert torch.equal(got, ref), (shape, double, dtype, vector, threads)
            assert torch.equal(_bits(bnb4.dequantize(q, dtype)), ref)  # dequantize takes the kernel


def test_nan_inf_and_ties_as_torch_rounds_them(monkeypatch):
    q = bnb4.quantize(torch.randn(10, 100), "nf4", 64, double_quant=False)
    # NF4 index 15 is 1.0, so a block's absmax is one of its values: ties to even in fp16 subnormals
    # (1.5, 2.5 and 0.5 units of 2^-24), fp16 normals (1 + 1/2 and 3/2 ulp) and bf16 (1 + 1/2 and 3/2 ulp)
    q.absmax.copy_(torch.tensor([float("inf"), float("nan"), -float("inf"), 3e38, 1e-40, -0.0, 7e4, 0.0,
                                 3 * 2.0 ** -25, 5 * 2.0 ** -25, 2.0 ** -25, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                                 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65520.0]))
    q.absmax.view(torch.int32)[7] = 0x7F812345  # a signalling NaN with a payload
    for dtype in DTYPES:
        ref = _bits(_torch_path(monkeypatch, q, dtype))
        for vector in (True, False):
            assert torch.equal(_bits(_native(q, dtype, vector=vector)), ref), (dtype, vector)


def test_falls_back_to_torch_without_the_kernel(monkeypatch, tmp_path):
    q = bnb4.quantize(torch.randn(5, 70), "fp4", 64, double_quant=True)
    want = _bits(_torch_path(monkeypatch, q, torch.bfloat16))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    for env, value in (("KILN_NATIVE", "0"), ("CC", str(tmp_path / "no-such-cc")), ("CC", "false")):
        build.forget("dequant4")
        monkeypatch.setenv(env, value)
        assert build.load("dequant4", SOURCE) is None, (env, value)
        out = torch.empty(5, 70, dtype=torch.bfloat16)
        assert not dequant4.dequantize4(q.packed, 350, 64, q.code, q.absmax, q.nested_absmax, q.nested_code, 256,
                                        q.offset, out)
        assert torch.equal(_bits(bnb4.dequantize(q, torch.bfloat16)), want), (env, value)
        monkeypatch.delenv(env)
    assert not list(tmp_path.rglob("*.so"))
    build.forget("dequant4")
    # not contiguous, or a dtype it does not write: False, nothing written
    out = torch.empty(70, 5, dtype=torch.bfloat16).t()
    assert not dequant4.dequantize4(q.packed, 350, 64, q.code, q.absmax, q.nested_absmax, q.nested_code, 256,
                                    q.offset, out)


def test_concurrent_builds_leave_one_whole_library(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    paths, errors = [], []

    def build_once():
        try:
            paths.append(build._build("dequant4", SOURCE))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build_once) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    # no temporaries left: the library and its size and digest record
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [paths[0].name, paths[0].name + ".sum"]
    assert build._build("dequant4", SOURCE) == paths[0]  # cached: found, not built again
    # a different source is a different library
    assert build.library_path("dequant4", SOURCE + "\n") != paths[0]


def test_cc_with_its_own_words_builds_and_a_failing_one_is_named(monkeypatch, tmp_path, caplog):
    """`$CC` is a command (`cc -g`): split as a shell would; a compiler that fails says so once, as a warning."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "cc -g")
    build.forget("dequant4")
    try:
        assert build.load("dequant4", SOURCE) is not None
        with_g = build.library_path("dequant4", SOURCE)
        monkeypatch.setenv("CC", "cc")
        assert build.library_path("dequant4", SOURCE) != with_g  # the flags are part of the key
        build.forget("dequant4")
        monkeypatch.setenv("CC", "false --version")
        with caplog.at_level(logging.DEBUG, logger="kiln.kernels.build"):
            assert build.load("dequant4", SOURCE) is None
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "dequant4" in warned[0].getMessage() and "compile failed" in warned[0].getMessage()
    finally:
        build.forget("dequant4")


def _rewrite(path, data: bytes) -> None:
    """Put `data` at `path` as a new file, as another process's broken copy would: writing into the file in place
    would also change the pages of a copy this process has loaded (the loop below loads one, then poisons it
    again), which crashed the test process at exit."""
    tmp = path.with_name(path.name + ".poison")
    tmp.write_bytes(data)
    tmp.replace(path)


def _poisoned_loads(monkeypatch, tmp_path, caplog, poison) -> tuple[object, list[str]]:
    """Build the kernel, `poison(path)` the cached library, then load it afresh in a new process's manner."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    build.forget("dequant4")
    path = build._build("dequant4", SOURCE)
    poison(path)
    build.forget("dequant4")
    with caplog.at_level(logging.WARNING, logger="kiln.kernels.build"):
        lib = build.load("dequant4", SOURCE)
    build.forget("dequant4")
    return lib, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_truncated_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path, caplog):
    """A library cut after a valid ELF header (a full disk, a killed copy) crashed dlopen with SIGBUS; now its
    size and digest record refuse it, it is rebuilt with one warning, and the kernel gives the torch values."""
    def truncate(path):
        data = path.read_bytes()
        assert data[:4] == b"\x7fELF"
        _rewrite(path, data[:len(data) // 3])

    lib, warned = _poisoned_loads(monkeypatch, tmp_path, caplog, truncate)
    assert lib is not None
    assert len(warned) == 1 and "was rebuilt" in warned[0] and "does not match its record" in warned[0], warned
    path = build.library_path("dequant4", SOURCE)
    assert build._cached_ok(path) is None and path.read_bytes()[:4] == b"\x7fELF"
    q = bnb4.quantize(torch.randn(3, 64), "nf4", 64, double_quant=True)
    out = torch.empty(3, 64, dtype=torch.float32)
    assert dequant4.dequantize4(q.packed, 192, 64, q.code, q.absmax, q.nested_absmax, q.nested_code, 256, q.offset, out)
    assert torch.equal(out, _torch_path(monkeypatch, q, torch.float32))
    build.forget("dequant4")


def test_a_library_without_its_record_or_with_one_flipped_byte_is_rebuilt(monkeypatch, tmp_path, caplog):
    def flip(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, another digest
        _rewrite(path, bytes(data))

    for poison, says in ((lambda p: build.sum_path(p).unlink(), "has no size and digest record"),
                         (flip, "does not match its record")):
        caplog.clear()
        lib, warned = _poisoned_loads(monkeypatch, tmp_path, caplog, poison)
        assert lib is not None and len(warned) == 1 and says in warned[0], warned


def test_a_poisoned_library_that_cannot_be_rebuilt_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    def truncate_and_break_cc(path):
        _rewrite(path, path.read_bytes()[:200])
        # the compiler fails now (a full disk); the same command, so the same cache key
        monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
            a, 1, "", "cc1: fatal error: No space left on device"))

    lib, warned = _poisoned_loads(monkeypatch, tmp_path, caplog, truncate_and_break_cc)
    assert lib is None
    assert len(warned) == 1 and "using the slower torch path" in warned[0], warned
    assert "was refused (it does not match its record" in warned[0] and "No space left on device" in warned[0]
