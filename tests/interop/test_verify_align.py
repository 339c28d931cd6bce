"""verify-export compares operations, not addresses: weights that loaders leave off a 64-byte boundary are
moved onto one before both models run (some BLAS kernels sum in another order for an unaligned operand)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from kiln.interop.verify import ALIGN, compare_models, realign
from kiln.models.tasks import get_task


def _offset_copy(t: torch.Tensor, floats: int) -> torch.Tensor:
    """`t`'s values in a block starting `floats` float32s past an aligned address."""
    buf = torch.empty(t.numel() + floats)
    out = buf[floats:].view_as(t)
    out.copy_(t)
    return out


class _Gate(nn.Module):
    """a Linear(dim, 1) gate, Qwen's `shared_expert_gate` shape: MKL computes it as a GEMV."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 1, bias=False)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, input_ids=None, **_):
        x = torch.sin(input_ids.float().unsqueeze(-1) * torch.arange(1, 33))  # (B, T, 32)
        return {"logits": self.gate(x.view(-1, 32)).view(*input_ids.shape, 1) * self.scale}


def test_realign_moves_only_unaligned_and_keeps_values_and_ties():
    m = _Gate()
    w = m.gate.weight.detach().clone()
    m.gate.weight.data = _offset_copy(w, 6)  # 24 bytes past the boundary: where transformers' loader left it
    aligned_before = m.scale.data_ptr()
    assert m.gate.weight.data_ptr() % ALIGN
    assert realign(m) == 1
    assert m.gate.weight.data_ptr() % ALIGN == 0 and torch.equal(m.gate.weight, w)
    assert m.scale.data_ptr() == aligned_before  # an aligned tensor stays where it is
    assert isinstance(m.gate.weight, nn.Parameter) and realign(m) == 0


def test_compare_models_equal_whatever_the_addresses():
    """Two models with the same weights at different alignments: every output equal. (Without realign this
    failed on AMD EPYC with AVX-512, 1e-7 apart; other CPUs pass either way.)"""
    ours, theirs = _Gate(), _Gate()
    theirs.load_state_dict(ours.state_dict())
    for offset, m in ((0, ours), (6, theirs)):
        m.gate.weight.data = _offset_copy(ours.gate.weight.detach().clone(), offset)
    ids = torch.randint(0, 1000, (2, 19), generator=torch.Generator().manual_seed(0))
    checks = compare_models(ours, theirs, get_task("causal-lm"), SimpleNamespace(vocab_size=1000), [{"input_ids": ids}])
    assert checks and all(c.ok for c in checks), [c.line() for c in checks]
