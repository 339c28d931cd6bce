"""Images to model inputs, on Pillow: the Qwen-VL patch processor and a fixed-size classifier processor.

`QwenImageProcessor` does what transformers' Qwen2-VL image processor (which Qwen3-VL and Qwen3.5 use)
does, with the same arithmetic, so the outputs are equal bit for bit:

  RGB (alpha composited on white) -> bicubic resize to the "smart" size (each side a multiple of
  patch * merge, the area within [min_pixels, max_pixels], the aspect ratio kept as near as that allows)
  -> uint8 * (1/255) in float64, to float32 -> (x - mean) / std -> patches (grid_h * grid_w,
  C * temporal * patch * patch), each merge x merge block of patches together, the still image
  repeated over the temporal patch; `image_grid_thw` (1, grid_h, grid_w) per image.

`ImageClassifierProcessor` is ViTImageProcessor's: resize to a square, rescale, normalise, (C, H, W).
A one-channel image wider than 8 bits (16-bit grayscale PNG: mode I;16; I; F) is first scaled to 8-bit grey over
its value range (where Pillow's convert would clip it, and transformers with it), or refused outside that range.
Pillow is the `kiln[vision]` extra.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.hub.files import why_unreadable

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
ImageLike = Union[str, os.PathLike[str], "PILImage"]  # a path or a PIL image


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise KilnError("images need Pillow: pip install 'kiln[vision]'") from None
    return Image


def open_image(image: ImageLike, max_pixels: int | None = None, what: str = "image") -> PILImage:
    """A PIL image in RGB (transparency composited on white, as transformers does) from a path or an image;
    a missing or unreadable file, or one over `max_pixels` (width x height), is an error naming it."""
    Image = _pil()
    name = what
    if isinstance(image, (str, os.PathLike)):
        name = str(image)
        why = why_unreadable(image, empty_ok=False)
        if why is not None:  # a dangling link or an unreadable file is named, not "does not exist"
            raise KilnError(f"{what}: image file {name} {why}")
        try:
            with Image.open(image) as f:
                f.load()
                image = f.copy()
        except (OSError, Image.DecompressionBombError, ValueError) as e:
            raise KilnError(f"{what}: cannot read image {name}: {e}") from None
    if not isinstance(image, Image.Image):
        raise KilnError(f"{what}: expected an image path or a PIL image, got {type(image).__name__}")
    w, h = image.size
    if max_pixels is not None and w * h > max_pixels:
        raise KilnError(f"{what}: image {name} is {w}x{h} = {w * h} pixels, over the budget of {max_pixels}")
    image = _to_8bit(image, name, what)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


# Pillow's modes of one wide channel: 16-bit (a 16-bit grayscale PNG opens as I;16), 32-bit integer, float
_WIDE = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535, "I": 65535, "F": 1.0}


def _to_8bit(image: PILImage, name: str, what: str) -> PILImage:
    """A one-channel image wider than 8 bits as 8-bit grey over its value range (0..65535 for the integer
    modes, 0..1 for float), rounded: Pillow's convert("RGB") clips instead, so a 16-bit PNG came out almost all
    white. Values outside that range (a 32-bit or float image of other units) are refused, naming the range."""
    top = _WIDE.get(image.mode)
    if top is None:
        return image
    Image = _pil()
    values = np.asarray(image).astype(np.float64)
    lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if not (np.isfinite(values).all() and lo >= 0 and hi <= top):
        raise KilnError(f"{what}: image {name} is mode {image.mode} with values {lo:g}..{hi:g}, outside the "
                        f"0..{top:g} that kiln reads as black..white for this mode; save it as 8- or 16-bit")
    grey = np.rint(values * (255.0 / top)).astype(np.uint8)
    return Image.fromarray(grey, mode="L")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the Qwen-VL processors resize to: each side a multiple of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio as near the original as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise KilnError(f"image of {width}x{height}: aspect ratio over 200 is not supported")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _normalised(image, mean: tuple[float, ...], std: tuple[float, ...], rescale: float) -> np.ndarray:
    """(H, W, 3) uint8 -> (3, H, W) float32 as transformers rescales (in float64) and normalises (in float32)."""
    x: np.ndarray = (np.asarray(image, dtype=np.uint8).astype(np.float64) * rescale).astype(np.float32)
    x = (x - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


@dataclass
class QwenImageProcessor:
    """The Qwen-VL image processor's settings (preprocessor_config.json's names) and its call."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    max_input_pixels: int | None = None  # refuse larger source images (a budget), instead of downsizing them
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QwenImageProcessor:
        data = dict(data)
        size = data.pop("size", None) or {}
        data.setdefault("min_pixels", size.get("shortest_edge", cls.min_pixels))
        data.setdefault("max_pixels", size.get("longest_edge", cls.max_pixels))
        names = {"patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean",
                 "image_std", "rescale_factor", "max_input_pixels"}
        out = cls(**{k: v for k, v in data.items() if k in names})
        out.image_mean, out.image_std = tuple(out.image_mean), tuple(out.image_std)
        out.extra = {k: v for k, v in data.items() if k not in names}
        return out

    @classmethod
    def for_model(cls, model_dir: str | os.PathLike, vision_config: dict[str, Any] | None = None
                  ) -> QwenImageProcessor:
        """From the directory's preprocessor_config.json, else the vision config's patch sizes (CLIP mean/std)."""
        path = Path(model_dir) / "preprocessor_config.json"
        if path.is_file():
            import json

            return cls.from_dict(json.loads(path.read_text()))
        v = vision_config or {}
        return cls(patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
                   merge_size=v.get("spatial_merge_size", 2))

    def to_dict(self) -> dict[str, Any]:
        """preprocessor_config.json as transformers' Qwen-VL processors read it (keys read from a file kept)."""
        names = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "rescale_factor")
        out = {"image_processor_type": "Qwen2VLImageProcessor", **self.extra, **{k: getattr(self, k) for k in names}}
        out.update(image_mean=list(self.image_mean), image_std=list(self.image_std),
                   size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels})
        return out

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def tokens_for(self, grid_thw: list[int] | torch.Tensor) -> int:
        """Placeholder tokens an image of this grid takes in the text (merged patches)."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.merge_size ** 2

    def patchify(self, x: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """(C, H, W) float32 -> patches (gh * gw, C * Tp * P * P) in merge-block order, and [1, gh, gw]."""
        C, H, W = x.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = H // p, W // p
        blocks = x.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, m, m, C, p, p)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))  # still image over time
        return torch.from_numpy(np.ascontiguousarray(blocks).reshape(gh * gw, C * tp * p * p)), [1, gh, gw]

    def __call__(self, images: Sequence[ImageLike], what: str = "image") -> dict[str, torch.Tensor]:
        """{"pixel_values": (patches, C*Tp*P*P) float32, "image_grid_thw": (images, 3) long}."""
        Image = _pil()
        patches, grids = [], []
        for i, image in enumerate(images):
            img = open_image(image, self.max_input_pixels, f"{what} {i}" if len(images) > 1 else what)
            h, w = self.target_size(img.height, img.width)
            img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
            x = _normalised(img, self.image_mean, self.image_std, self.rescale_factor)
            pix, grid = self.patchify(x)
            patches.append(pix)
            grids.append(grid)
        return {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


@dataclass
class ImageClassifierProcessor:
    """ViTImageProcessor's defaults: bilinear resize to size x size, rescale, normalise with mean = std = 0.5."""
    size: int = 224
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    max_input_pixels: int | None = None

    def __call__(self, images: Sequence[ImageLike], what: str = "image") -> torch.Tensor:
        """(N, 3, size, size) float32."""
        Image = _pil()
        out = []
        for i, image in enumerate(images):
            img = open_image(image, self.max_input_pixels, f"{what} {i}" if len(images) > 1 else what)
            img = img.resize((self.size, self.size), resample=Image.Resampling.BILINEAR)
            out.append(torch.from_numpy(_normalised(img, self.image_mean, self.image_std, self.rescale_factor)))
        return torch.stack(out)
