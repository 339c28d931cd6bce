"""ViT beyond the parity harness (which compares both heads bit for bit with transformers, at the model's size and
on a larger non-square image through interpolate_pos_encoding): the resampling is a no-op at the trained size,
real at others; bad pixel inputs by message."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.models import AutoModelForImageClassification


def test_interpolated_positions_and_bad_inputs(tiny_factory):
    model = AutoModelForImageClassification.from_pretrained(tiny_factory("vit", "image-classification"))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same = model(x, interpolate_pos_encoding=True).logits
        assert torch.equal(same, model(x).logits)  # the trained grid: the table itself
        emb = model.model.embeddings
        wide = emb.positions(1 + 4 * 6, 16, 24)  # 4x6 patches: the 4x4 table resampled
        assert wide.shape == (1, 25, 32) and torch.equal(wide[:, 0], emb.position_embeddings[:, 0])
        assert not torch.equal(wide[:, 1:5], emb.position_embeddings[:, 1:5])  # control: resampled, not copied
    with pytest.raises(KilnError, match=r"input image size \(16\*24\) doesn't match the model's \(16\*16\)"):
        model(torch.randn(1, 3, 16, 24))
    with pytest.raises(KilnError, match="pixel_values has 1 channels; this model takes 3"):
        model(torch.randn(1, 1, 16, 16))
