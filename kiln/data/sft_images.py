"""Image-text SFT rows: chat messages whose `content` is a list of parts.

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "digits/7.png"},
                                               {"type": "text", "text": "what digit is this?"}]},
                  {"role": "assistant", "content": "7"}]}

Image paths are relative to the records file. Each message's parts become one string before the chat
template sees it: text parts as written, each image part as the model's vision start, image placeholder and
vision end tokens (what Qwen's templates render for an image part), so any template renders them. After
tokenizing, the rendered text must hold exactly one placeholder per image part (a template that drops a
message, or a placeholder typed in the text, is an error naming the row and both counts); each placeholder is
then expanded to the image's merged patch count, as transformers' Qwen-VL processor does, and never carries
loss. An example carries its images' `pixel_values` (patches, C*Tp*P*P) and `image_grid_thw` (images, 3);
packed rows concatenate them in sample order. A sample cut by max_length inside an image is cut before that
image instead (an image is never half in a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.constants import IGNORE_INDEX
from kiln.data.images import QwenImageProcessor
from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub.files import why_unreadable


@dataclass
class ImageTokens:
    """What an image-text model needs of its data: the processor and its vision tokens (as text and ids)."""
    processor: QwenImageProcessor
    image_id: int
    image_token: str
    start: str | None = None          # vision start / end around each image's placeholders
    end: str | None = None
    start_id: int | None = None
    root: Path = Path(".")            # image paths are relative to this (the records file's folder)

    @property
    def patch_dim(self) -> int:
        p = self.processor
        return 3 * p.temporal_patch_size * p.patch_size ** 2

    def image_text(self) -> str:
        return (self.start or "") + self.image_token + (self.end or "")


def flatten_parts(messages: Any, spec: ImageTokens, where: str) -> tuple[Any, list[Path]]:
    """Messages with every list of parts made one string, and the image paths in order. Messages that are
    not lists of parts pass as they are (the SFT checks judge them)."""
    if not isinstance(messages, list):
        return messages, []
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), list):
            out.append(m)
            continue
        text = []
        for j, part in enumerate(m["content"]):
            at = f"{where}: messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind == "image" and isinstance(part.get("image"), str):
                why = why_unreadable(spec.root / part["image"], empty_ok=False)
                if why is not None:
                    raise KilnError(f"{at}: image {spec.root / part['image']} {why}")
                images.append(spec.root / part["image"])
                text.append(spec.image_text())
            else:
                raise KilnError(f"{at} must be {{\"type\": \"text\", \"text\": str}} or {{\"type\": \"image\", "
                                f"\"image\": path relative to the records file}}, got {str(part)[:80]}")
        out.append({**m, "content": "".join(text)})
    return out, images


def expand_images(ids: list[int], labels: list[int], images: list[Path], spec: ImageTokens, where: str
                  ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """Each placeholder widened to its image's merged patch count (no loss on them), and the pixel inputs."""
    found = ids.count(spec.image_id)
    if found != len(images):
        more = ("more image parts than placeholders (the chat template drops a message that holds an image?)"
                if len(images) > found else f"more placeholders than image parts (is {spec.image_token!r} "
                                            f"written in a text part?)")
        raise KilnError(f"{where}: {len(images)} image part(s) but {found} image placeholder(s) "
                        f"{spec.image_token!r} in the rendered chat: {more}")
    if not images:
        return ids, labels, empty_images(spec)
    inputs = spec.processor(images, what=where)
    counts = iter(spec.processor.tokens_for(g) for g in inputs["image_grid_thw"].tolist())
    out_ids, out_labels = [], []
    for t, lab in zip(ids, labels):
        n = next(counts) if t == spec.image_id else 1
        out_ids += [t] * n
        out_labels += [IGNORE_INDEX] * n if t == spec.image_id else [lab]
    return out_ids, out_labels, inputs


def empty_images(spec: ImageTokens) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.zeros(0, spec.patch_dim), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}


def truncate_images(ids: list[int], labels: list[int], inputs: dict[str, torch.Tensor], spec: ImageTokens,
                    max_length: int) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """The first `max_length` tokens, or fewer so that no image is cut: a cut image goes (with its vision
    start) and so do the images after it."""
    cut, kept, at, patches = max_length, 0, 0, 0
    for g in inputs["image_grid_thw"].tolist():
        at = ids.index(spec.image_id, at)
        n = spec.processor.tokens_for(g)
        if at + n > max_length:
            cut = at - 1 if at > 0 and spec.start_id is not None and ids[at - 1] == spec.start_id else at
            break
        kept, patches, at = kept + 1, patches + g[0] * g[1] * g[2], at + n
    return ids[:cut], labels[:cut], {"pixel_values": inputs["pixel_values"][:patches],
                                     "image_grid_thw": inputs["image_grid_thw"][:kept]}


def encode_image_record(record: Record, spec: ImageTokens, encode, max_length: int
                        ) -> tuple[list[int], list[int], dict[str, torch.Tensor], bool]:
    """(ids, labels, pixel inputs, truncated) of one record; `encode(record)` gives its (ids, labels) unexpanded."""
    messages, images = flatten_parts(record.fields.get("messages"), spec, record.where)
    if "messages" in record.fields:
        record = Record({**record.fields, "messages": messages}, record.where)
    ids, labels = encode(record)
    ids, labels, inputs = expand_images(ids, labels, images, spec, record.where)
    if len(ids) <= max_length:
        return ids, labels, inputs, False
    ids, labels, inputs = truncate_images(ids, labels, inputs, spec, max_length)
    return ids, labels, inputs, True
