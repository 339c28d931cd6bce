"""kiln's image processors (kiln/data/images.py) against transformers' Pillow ones, bit for bit: the Qwen-VL
processor (smart resize, rescale, normalise, patchify) on several sizes and modes, ViT's on the same; bad
images by message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.data.images import ImageClassifierProcessor, QwenImageProcessor, smart_resize
from kiln.errors import KilnError

PIL = pytest.importorskip("PIL.Image")


def _images() -> list:
    """RGB of odd sizes (one under min_pixels, one over max_pixels, one wide), grayscale, and RGBA."""
    rng = np.random.default_rng(0)
    out = [PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
           [(37, 53), (20, 20), (300, 410), (64, 250)]]
    out.append(PIL.fromarray(rng.integers(0, 256, (45, 33), dtype=np.uint8), mode="L"))
    out.append(PIL.fromarray(rng.integers(0, 256, (40, 60, 4), dtype=np.uint8), mode="RGBA"))
    return out


def test_qwen_processor_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=96 * 96,
                    image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    ours = QwenImageProcessor.from_dict(settings)
    theirs = Qwen2VLImageProcessorPil(**settings)
    images = _images()
    want = theirs(images, return_tensors="pt")
    got = ours(images)
    assert got["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.float32
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    # each size rule hit: under min_pixels grows, over max_pixels shrinks, multiples of patch * merge
    grids = got["image_grid_thw"].tolist()
    assert grids[1][1] * grids[1][2] * 16 >= 32 * 32 and grids[2][1] * grids[2][2] * 16 <= 96 * 96
    # and the defaults (CLIP mean/std, patch 14) through a fresh transformers processor
    assert torch.equal(QwenImageProcessor()(images[:2])["pixel_values"],
                       Qwen2VLImageProcessorPil()(images[:2], return_tensors="pt")["pixel_values"])
    # control: one pixel changed changes the patches
    img = np.array(images[0])
    img[0, 0, 0] ^= 1
    assert not torch.equal(ours([PIL.fromarray(img)])["pixel_values"], ours(images[:1])["pixel_values"])


def test_smart_resize_rules():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    assert smart_resize(37, 53, 28, 56 * 56, 28 * 28 * 1280) == (56, 84)  # grown past min_pixels: ceil per side
    for h in range(10, 2000, 97):
        for w in range(10, 2000, 89):
            assert smart_resize(h, w, 32, 64 * 64, 512 * 512) == theirs(h, w, 32, 64 * 64, 512 * 512), (h, w)
    h, w = smart_resize(3000, 4000, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 1280 and abs(w / h - 4 / 3) < 0.05
    with pytest.raises(KilnError, match="aspect ratio"):
        smart_resize(1, 500, 28, 56 * 56, 28 * 28 * 1280)


def test_classifier_processor_equals_vit():
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    images = _images()[:4]  # RGB: ViT's processor does not convert other modes
    want = ViTImageProcessorPil(size={"height": 24, "width": 24})(images, return_tensors="pt")["pixel_values"]
    assert torch.equal(ImageClassifierProcessor(size=24)(images), want)


def test_bad_images_by_message(tmp_path):
    ours = QwenImageProcessor(max_input_pixels=40 * 40)
    with pytest.raises(KilnError, match="missing.png does not exist"):
        ours([tmp_path / "missing.png"])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(KilnError, match="cannot read image .*broken.png"):
        ours([tmp_path / "broken.png"])
    PIL.new("RGB", (50, 41)).save(tmp_path / "big.png")
    with pytest.raises(KilnError, match="big.png is 50x41 = 2050 pixels, over the budget of 1600"):
        ours([tmp_path / "big.png"])
