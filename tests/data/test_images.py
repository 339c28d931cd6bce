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


def test_16bit_and_float_grayscale_keep_their_value_range(tmp_path):
    """A 16-bit grayscale PNG (mode I;16) used to come out ~all white (Pillow's convert clips to 255); now its
    pixels are the 8-bit image of the same picture: equal to rounding value * 255 / 65535, statistics and all."""
    from kiln.data.images import open_image

    rng = np.random.default_rng(0)
    wide = rng.integers(0, 65536, (48, 40), dtype=np.uint16)
    PIL.fromarray(wide).save(tmp_path / "g16.png")
    opened = PIL.open(tmp_path / "g16.png")
    assert opened.mode == "I;16"
    assert (np.asarray(opened.convert("RGB")) == 255).mean() > 0.9  # the bug this guards against: clipped white
    got = np.asarray(open_image(tmp_path / "g16.png"))
    want = np.rint(wide / 257.0).astype(np.uint8)
    assert got.shape == (48, 40, 3) and (got == want[..., None]).all()
    # statistics of a uniform 0..65535 picture: mean 127.5 and 1/256 of the pixels white (within 5 sigma)
    n = wide.size
    assert abs(got.mean() - 127.5) < 5 * 73.6 / np.sqrt(n), got.mean()
    assert (got == 255).mean() < 1 / 256 + 5 * np.sqrt(1 / 256 / n)
    # mode I (32-bit, what older Pillow opened 16-bit PNGs as) and F (float in 0..1) read the same way
    i32 = PIL.fromarray(wide.astype(np.int32), mode="I")
    assert (np.asarray(open_image(i32))[..., 0] == want).all()
    f32 = PIL.fromarray((wide / 65535.0).astype(np.float32), mode="F")
    assert np.abs(np.asarray(open_image(f32))[..., 0].astype(int) - want).max() <= 1  # float32 rounding
    # an 8-bit grey image is untouched (a control: the scaling applies to wide modes only)
    grey = rng.integers(0, 256, (8, 8), dtype=np.uint8)
    assert (np.asarray(open_image(PIL.fromarray(grey, mode="L")))[..., 0] == grey).all()


def test_wide_images_outside_their_range_are_refused():
    from kiln.data.images import open_image

    with pytest.raises(KilnError, match=r"mode F with values -1\.\.2, outside the 0\.\.1"):
        open_image(PIL.fromarray(np.array([[-1.0, 2.0]], dtype=np.float32), mode="F"), what="row 3")
    with pytest.raises(KilnError, match=r"mode I with values 0\.\.70000, outside the 0\.\.65535"):
        open_image(PIL.fromarray(np.array([[0, 70000]], dtype=np.int32), mode="I"))
    with pytest.raises(KilnError, match=r"mode F with values nan"):
        open_image(PIL.fromarray(np.array([[np.nan, 0.5]], dtype=np.float32), mode="F"))
