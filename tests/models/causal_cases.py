"""Inputs and the exact comparison shared by the causal-LM parity tests (not a test module)."""

from __future__ import annotations

import torch


def batches() -> list[dict]:
    """One short row; a batch with labels; the same with right and left padding (padding has no loss)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 99, (3, 13), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0   # right padding
    attn[2, :4] = 0   # left padding
    labels = ids.clone()
    labels[attn == 0] = -100
    labels[0, :5] = -100  # a prompt part without loss
    return [{"input_ids": ids[:1, :6]}, {"input_ids": ids, "labels": labels},
            {"input_ids": ids, "attention_mask": attn, "labels": labels}]


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-identical: same shape, dtype and values (rtol = atol = 0)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
