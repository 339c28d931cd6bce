"""kiln's NF4/FP4 blockwise quantizer (kiln.hub.bnb4) against bitsandbytes' own on CPU: packed bytes,
absmax, nested absmax, both quant maps and the packed quant-state JSON equal byte for byte; dequantized
weights equal `dequantize_4bit` bit for bit in every output dtype, whole or a chunk at a time, through the
C kernel and through the torch path."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError, WeightsError
from kiln.hub import bnb4

F = pytest.importorskip("bitsandbytes.functional")

# element counts: multiples of 64, partial last blocks, odd totals, > 256 blocks (several nested blocks)
SHAPES = [(64, 64), (7, 45), (3, 5), (257, 130), (33,), (1, 1)]


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # blocks of very unequal scale
    w.view(-1)[::11] = 0.0
    return w.to(dtype)


def _bits(t):
    """The bits, but any zero as +0: bitsandbytes' own FP4 index 8 dequantizes to -0 in its C++ kernel (a weight
    whose last dimension is even) and +0 in its torch one (odd), from the +0 of its code table, as kiln does."""
    return (t + 0.0).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _bnb(w, quant_type, double):
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type=quant_type)
    return q, state


@pytest.mark.parametrize("quant_type", bnb4.QUANT_TYPES)
@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_equals_bitsandbytes_byte_for_byte(quant_type, double, dtype):
    for i, shape in enumerate(SHAPES):
        w = _weight(shape, dtype, i)
        ref_packed, state = _bnb(w, quant_type, double)
        ours = bnb4.quantize(w, quant_type, 64, double)
        ref = {"w": ref_packed, **{f"w.{k}": v for k, v in state.as_dict(packed=True).items()}}
        got = ours.tensors("w")
        assert sorted(got) == sorted(ref), shape
        for k in ref:
            assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, (shape, k)
            assert torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8)), (shape, k)  # bytes: +0 is not -0


@pytest.mark.parametrize("quant_type", bnb4.QUANT_TYPES)
@pytest.mark.parametrize("native", ["1", "0"])  # the C kernel (kiln.kernels.dequant4), and the torch path without it
def test_dequantize_equals_bitsandbytes_bit_for_bit(monkeypatch, quant_type, native):
    monkeypatch.setenv("KILN_NATIVE", native)
    # bitsandbytes compiles its generic (odd last dimension) path; eager runs the same ops, without the wait
    with torch._dynamo.config.patch(disable=True):
        _dequantize_cases(quant_type)


def _dequantize_cases(quant_type):
    for i, shape in enumerate([(64, 64), (7, 45), (257, 130), (33,)]):
        for double in (True, False):
            w = _weight(shape, torch.bfloat16, 10 + i)
            packed, state = _bnb(w, quant_type, double)
            ours = bnb4.quantize(w, quant_type, 64, double)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                state.dtype = dtype
                ref = F.dequantize_4bit(packed, state)
                got = bnb4.dequantize(ours, dtype)
                assert got.dtype == ref.dtype and torch.equal(_bits(got), _bits(ref)), (shape, double, dtype)
                # a chunk at a time into a given tensor (3 blocks a chunk; whole groups of 256 when nested),
                # ending in a partial group and a partial block
                into = torch.full_like(ref, float("nan"))
                assert bnb4.dequantize(ours, dtype, out=into, chunk_bytes=96) is into
                assert torch.equal(_bits(into), _bits(ref)), (shape, double, dtype, "chunked")
            # a round trip through the HF tensors reads the same weight back
            again = bnb4.read_quant4(ours.tensors("x.weight"), "x.weight")
            assert torch.equal(bnb4.dequantize(again), bnb4.dequantize(ours))


def test_nested_rounding_is_bitsandbytes_table_not_exact_nearest():
    """The control: bitsandbytes' CPU 8-bit step rounds through a 65536-point table, which differs from an
    exact nearest-code rounding on some absmax values, so the byte comparison above can tell them apart."""
    w = _weight((4096, 17), torch.float32, 3)
    _, state = _bnb(w, "nf4", True)
    flat = w.reshape(-1)
    absmax = flat.reshape(-1, 64).abs().amax(1)
    x = absmax - absmax.mean()
    code = bnb4.dynamic_code()
    scale = state.state2.absmax.repeat_interleave(256)[:x.numel()]
    exact = (x / scale).unsqueeze(1).sub(code).abs().argmin(1).to(torch.uint8)
    assert not torch.equal(exact, state.absmax)
    assert torch.equal(bnb4.quantize(w, "nf4").absmax, state.absmax)


def test_quantization_error_is_within_half_a_code_step():
    w = _weight((96, 200), torch.float32, 5)
    for quant_type in bnb4.QUANT_TYPES:
        q = bnb4.quantize(w, quant_type, double_quant=False)
        code = torch.sort(bnb4.code4(quant_type)).values
        half_step = ((code[1:] - code[:-1]).max() / 2).item()
        err = (bnb4.dequantize(q, torch.float32) - w).abs().reshape(-1, 64)
        # per block: |w - deq| <= half the widest code gap times the block's absmax (+ float32 rounding)
        assert (err <= (half_step + 1e-6) * w.reshape(-1, 64).abs().amax(1, keepdim=True)).all()


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="unknown 4-bit quant type 'int4'"):
        bnb4.quantize(torch.ones(64), "int4")
    tensors = bnb4.quantize(torch.randn(8, 64), "nf4").tensors("m.weight")
    for part in ("m.weight.absmax", "m.weight.nested_absmax", "m.weight.quant_map"):
        broken = {k: v for k, v in tensors.items() if k != part}
        with pytest.raises(WeightsError, match=part.replace(".", r"\.")):
            bnb4.split_state(broken, "ckpt")
    no_state = {k: v for k, v in tensors.items() if "quant_state" not in k}
    with pytest.raises(WeightsError, match=r"m\.weight\.quant_state\.bitsandbytes__nf4"):
        bnb4.split_state(no_state, "ckpt")
