"""Inputs, labels and the exact comparison shared by the encoder parity tests (not a test module)."""

from __future__ import annotations

import torch

HEADS = ["base", "sequence-classification", "token-classification", "question-answering", "masked-lm"]
OUTPUTS = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits", "loss")


def batches(vocab: int, pad: int, token_types: bool, long: bool = False) -> list[dict]:
    """One short unpadded row; a right-padded batch; optionally a 40-token batch; optionally token types."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (4, 13), generator=g)
    attn = torch.ones_like(ids)
    for row, n in ((1, 9), (2, 4), (3, 1)):  # right padding of different lengths
        attn[row, n:] = 0
        ids[row, n:] = pad
    out = [{"input_ids": ids[:1, :7]}, {"input_ids": ids, "attention_mask": attn}]
    if long:  # distances past relative-position buckets and spans
        long_ids = torch.randint(5, vocab, (2, 40), generator=g)
        long_attn = torch.ones_like(long_ids)
        long_attn[1, 25:] = 0
        out.append({"input_ids": long_ids, "attention_mask": long_attn})
    if token_types:
        types = torch.zeros_like(ids)
        types[:, 6:] = 1
        out.append({"input_ids": ids, "attention_mask": attn, "token_type_ids": types * attn})
    return out


def labels_for(task: str, batch: dict, num_labels: int, vocab: int) -> dict:
    """Labels for a head's loss; padded positions ignored (-100), QA ends partly past the sequence."""
    g = torch.Generator().manual_seed(2)
    B, T = batch["input_ids"].shape
    if task == "sequence-classification":
        return {"labels": torch.randint(0, num_labels, (B,), generator=g)}
    if task in ("token-classification", "masked-lm"):
        labels = torch.randint(0, num_labels if task == "token-classification" else vocab, (B, T), generator=g)
        labels[batch.get("attention_mask", torch.ones_like(labels)) == 0] = -100
        return {"labels": labels}
    if task == "question-answering":
        return {"start_positions": torch.randint(0, T, (B,), generator=g),
                "end_positions": torch.randint(0, T + 4, (B,), generator=g)}  # past the end: clamped, ignored
    return {}


def assert_same(ours, theirs) -> int:
    """Every output transformers returns equals kiln's, bit for bit; returns how many were compared."""
    compared = 0
    for name in OUTPUTS:
        b = getattr(theirs, name, None)
        if b is None:
            continue
        a = getattr(ours, name)
        assert a is not None, f"kiln returned no {name}"
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # rtol = atol = 0: bit-identical (a loss over only ignored positions is NaN on both sides)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared >= 1
    return compared


def run_both(ours, hf, task: str, token_types: bool, long: bool = False) -> None:
    """Each batch, without and with labels, through both models."""
    c = hf.config
    num_labels = getattr(c, "num_labels", 2)
    for batch in batches(c.vocab_size, c.pad_token_id, token_types, long):
        for b in (batch, {**batch, **labels_for(task, batch, num_labels, c.vocab_size)}):
            with torch.no_grad():
                assert_same(ours(**b), hf(**b))
