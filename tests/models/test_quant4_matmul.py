"""The QLoRA matmul path's memory savings change no value: `quant4.matmul_weight` (dequantized into a reused
buffer, chunk by chunk) equals `dequantized` bit for bit, and the QLoRA linear over a 4-bit base with float32
adapters (qlora.QLoraUpdateFn) gives the outputs and gradients of the plain autograd form bit for bit while
keeping neither a float32 copy of the input nor a dequantized weight for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.hub import bnb4
from kiln.models.common import quant4
from kiln.models.common.lora import LoraLinear


def _linear4(shape, quant_type="nf4", double=True, blocksize=64, dtype=torch.bfloat16, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 0, shape[-1])
    w.view(-1)[::7] = 0.0  # exact zeros: index 0 and 8 of FP4, whose sign torch.equal would not see
    q = bnb4.quantize(w.to(dtype), quant_type, blocksize, double)
    m = quant4.Linear4(shape[1], shape[0], bias, quant4.Q4Meta.of(q), dtype, device="meta")
    m.load_quant4(q)
    if bias:
        m.bias = nn.Parameter(torch.randn(shape[0], generator=g).to(dtype), requires_grad=False)
    return m


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("quant_type", bnb4.QUANT_TYPES)
@pytest.mark.parametrize("native", ["1", "0"])  # the C kernel, and the torch path (in chunks) without it
def test_matmul_weight_equals_dequantized_bit_for_bit(monkeypatch, quant_type, native):
    monkeypatch.setenv("KILN_NATIVE", native)
    # chunks of 16 blocks (256 with double quant: whole absmax groups), so every weight here takes several,
    # and (17, 1024) (272 blocks) ends in a partial group of nested absmax
    monkeypatch.setattr(quant4, "_CHUNK_BYTES", 512)
    cases = [((96, 64), True, 64), ((17, 1024), True, 64), ((17, 1024), False, 64), ((64, 640), True, 128),
             ((7, 45), True, 64)]
    mods = [_linear4(shape, quant_type, double, blocksize, seed=i) for i, (shape, double, blocksize) in enumerate(cases)]
    with torch.inference_mode():  # a buffer made in inference mode must stay writable outside it (below)
        quant4.matmul_weight(mods[0], torch.float16)
    for case, m in zip(cases, mods):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            got, ref = quant4.matmul_weight(m, dtype), quant4.dequantized(m, dtype)
            assert got.dtype == ref.dtype and torch.equal(_bits(got), _bits(ref)), (case, dtype)
    # one buffer per (shape, dtype): a second weight of that shape is written where the first was
    wa = quant4.matmul_weight(mods[1], torch.bfloat16)
    wb = quant4.matmul_weight(mods[2], torch.bfloat16)
    assert wa.data_ptr() == wb.data_ptr() and torch.equal(_bits(wb), _bits(quant4.dequantized(mods[2])))


@pytest.mark.parametrize("scaling, bias", [(2.0, False), (1.5, True)])  # a power of two folds into (tokens, r)
def test_qlora_linear_keeps_only_the_input_as_it_came(monkeypatch, scaling, bias):
    torch.manual_seed(0)
    m = LoraLinear(_linear4((96, 128), bias=bias), r=8, alpha=16, dropout=0.0, scaling=scaling)
    nn.init.normal_(m.lora_B.weight, std=0.1)  # a nonzero update, so every gradient is exercised
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 7, 96, dtype=torch.bfloat16)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    assert (torch.float32, (2, 7, 128)) not in saved and (torch.float32, (14, 128)) not in saved, saved
    assert not any(shape == (96, 128) for _, shape in saved), saved  # no dequantized weight held either
    y.backward(grad)
    got = [y.detach(), x.grad, m.lora_A.weight.grad, m.lora_B.weight.grad]
    x.grad = m.lora_A.weight.grad = m.lora_B.weight.grad = None
    ref = quant4.linear4(x, m) + (m.lora_B(m.lora_A(x.float())) * m.scaling).to(torch.bfloat16)
    ref.backward(grad)
    want = [ref.detach(), x.grad, m.lora_A.weight.grad, m.lora_B.weight.grad]
    for name, g, w in zip(("output", "x grad", "lora_A grad", "lora_B grad"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    with torch.no_grad():
        assert torch.equal(m(x), want[0])
    # the base is dequantized once in forward, and in backward only for a gradient of x
    calls = []
    real = quant4.matmul_weight
    monkeypatch.setattr(quant4, "matmul_weight", lambda *a: calls.append(1) or real(*a))
    m(x).backward(grad)
    m(x.detach()).backward(grad)
    assert len(calls) == 3 and m.lora_A.weight.grad is not None
