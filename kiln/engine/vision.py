"""Image-text prompts on the generation engine (Qwen3.5 / Qwen3.6 image-text checkpoints, issue 39).

A request carries its images as kiln's processor gives them (`prompt_inputs`: `pixel_values` (patches,
C*Tp*P*P), `image_grid_thw` (images, 3); `mm_token_type_ids` optional, checked against the placeholders). At
admission (`prompt_images`) each image is keyed by a digest of its grid and pixel bytes; the vision tower runs
once per digest the engine has not seen (`ImageFeatures`, an LRU kept for the engine's life: a request's n
completions, a later request or chat turn showing the same image, and a repeated image inside one prompt all
reuse the features). The request keeps:

- its image rows: the prompt positions of the image placeholders and the merged features for them, in order
  (the k-th run of placeholders takes the k-th image, as the model's `embed_images` scatters them);
- its multimodal rotary positions (3, prompt length), computed by the model's own `image_positions`, and the
  offset (`delta`) at which text after the prompt continues: token t >= prompt length sits at t + delta on
  all three axes, as the model's cached decoding does.

`ImageTextRunner` is the hybrid runner (kiln.engine.hybrid: the Gated DeltaNet state per sequence, the gated
attention over the paged cache) with two changes in its forward: the rows of image placeholders take the
features in place of the token embedding, and each row's rotary angles come from its three positions (every
column of the runner's one rotary table read at the axis the model's interleaved sections give it: text rows,
with equal axes, read exactly the plain table's row). Every piece reads only its own rows of both, so a prefill
chunk that ends inside an image's placeholders, a decode step and the scoring forward (`token_logps` here)
give the same bits.

Prefix keys (kiln.engine.scheduler's content keys of full blocks) take the digests of the images whose
placeholders fall in a block (`ImagePrompt.salt`): two prompts with the same tokens and different images never
share a block. (The hybrid families keep a recurrent state and remember no prefix at all today; the key holds
for any family that does.)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from kiln.engine.hybrid import HybridRunner
from kiln.engine.runner import RUNNERS, Piece
from kiln.errors import KilnError
from kiln.models.common.rope import MRotaryEmbedding
from kiln.models.qwen3_5_vision import ImageTextForCausalLM, image_positions, token_types

INPUT_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
_FEATURE_BYTES = 256 << 20  # the engine keeps at most 256 MiB of image features for reuse


def image_digest(pixels: torch.Tensor, grid: list[int]) -> bytes:
    """The content key of one image: its grid, dtype and pixel bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{grid}|{pixels.dtype}|{tuple(pixels.shape)}|".encode())
    h.update(pixels.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


class ImageFeatures:
    """Merged image features by image digest, least recently used dropped past `max_bytes` (a request holding
    features keeps them alive). `tower_calls` counts the vision tower's runs."""

    def __init__(self, max_bytes: int = _FEATURE_BYTES):
        self.max_bytes, self.tower_calls = max_bytes, 0
        self._held: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        hit = self._held.get(key)
        if hit is not None:
            self._held.move_to_end(key)
            return hit
        out = make()
        self.tower_calls += 1
        self._held[key] = out
        size = sum(t.numel() * t.element_size() for t in self._held.values())
        while size > self.max_bytes and len(self._held) > 1:
            _, old = self._held.popitem(last=False)
            size -= old.numel() * old.element_size()
        return out

    def clear(self) -> None:
        """Drop every feature (the tower's weights changed)."""
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class ImagePrompt:
    """What a request with images carries (see the module docstring)."""
    rows: torch.Tensor        # (M,) prompt positions of the image placeholders, ascending
    features: torch.Tensor    # (M, C) the features placed there, in the model's dtype
    positions: torch.Tensor   # (3, prompt length) multimodal rotary positions
    delta: int                # text past the prompt: position t + delta on all three axes
    spans: list[tuple[int, int, bytes]]  # per image: its placeholders' [start, end) and its digest

    def rope(self, start: int, end: int) -> torch.Tensor:
        """(3, end - start) rotary positions of tokens start..end-1."""
        L = self.positions.shape[1]
        inside = self.positions[:, start:min(end, L)]
        past = torch.arange(max(start, L), max(end, L), device=inside.device) + self.delta
        return torch.cat([inside, past.expand(3, -1)], 1)

    def salt(self, start: int, end: int) -> bytes:
        """The digests (and first positions) of the images whose placeholders meet tokens start..end-1."""
        return b"".join(key + s.to_bytes(8, "little") for s, e, key in self.spans if s < end and e > start)


def _check_inputs(model: ImageTextForCausalLM, prompt: list[int], inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    unknown = sorted(set(inputs) - set(INPUT_KEYS))
    if unknown:
        raise KilnError(f"prompt_inputs has {unknown}: an image-text prompt takes {list(INPUT_KEYS)}")
    pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
        raise KilnError("prompt_inputs needs tensors pixel_values (patches, C*Tp*P*P) and image_grid_thw (images, 3), "
                        f"got {type(pixels).__name__} and {type(grid).__name__}")
    visual: Any = model.visual
    visual.check(pixels, grid)
    given = inputs.get("mm_token_type_ids")
    if given is not None:
        want = token_types(torch.tensor([prompt]), model.image_token_id, model.video_token_id)
        if tuple(given.reshape(1, -1).shape) != tuple(want.shape) or not torch.equal(given.reshape(1, -1).cpu(), want):
            raise KilnError("prompt_inputs.mm_token_type_ids does not mark the prompt's placeholders (image "
                            f"token id {model.image_token_id}); leave it out to have it read from the prompt")
    return pixels, grid.long()


def prompt_images(model: nn.Module, prompt: list[int], inputs: dict, cache: ImageFeatures) -> ImagePrompt | None:
    """Check a request's images against its prompt and make (or reuse) each image's features; None for inputs
    without an image (an image-text chat's text-only turns: `image_grid_thw` (0, 3)), the prompt then being text."""
    if not isinstance(model, ImageTextForCausalLM) or model.visual is None:
        raise KilnError(f"model_type {getattr(model.config, 'model_type', type(model).__name__)!r} takes no images: "
                        "image-text prompts (prompt_inputs given) need an image-text model with a vision tower")
    pixels, grid = _check_inputs(model, prompt, inputs)
    visual: Any = model.visual
    backbone: Any = model.model
    ids = torch.tensor([prompt])
    # the model's own positions (they also check each run of placeholders against its image's grid)
    pos, delta = image_positions(ids, token_types(ids, model.image_token_id, model.video_token_id), grid, None,
                                 visual.spatial_merge_size)
    if not len(grid):
        return None
    embed = backbone.embed_tokens.weight
    marks = (ids[0] == model.image_token_id).tolist()
    starts = [i for i, m in enumerate(marks) if m and (i == 0 or not marks[i - 1])]
    feats, spans, at = [], [], 0
    for k, (t, h, w) in enumerate(grid.tolist()):
        patches = pixels[at:at + t * h * w]
        at += t * h * w
        key = image_digest(patches, [t, h, w])
        n = t * h * w // visual.spatial_merge_size ** 2

        feats.append(cache.get(key, partial(_tower, visual, patches, (t, h, w), embed.dtype)))
        spans.append((starts[k], starts[k] + n, key))
    rows = torch.tensor([i for i, m in enumerate(marks) if m], dtype=torch.long, device=embed.device)
    return ImagePrompt(rows, torch.cat(feats), pos[:, 0].to(embed.device), int(delta), spans)


def _tower(visual: Any, patches: torch.Tensor, grid: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """One image's merged features (its placeholders' count, C) in `dtype`, without gradient: one image per call,
    so its features never depend on what else is admitted."""
    weight = visual.patch_embed.proj.weight
    was = visual.training
    visual.eval()
    try:
        with torch.no_grad():
            out = visual(patches.to(weight.device, weight.dtype), torch.tensor([grid], device=weight.device))
    finally:
        visual.train(was)
    return out.to(dtype)


@dataclass
class Placement:
    """The image rows and rotary positions of one call of the runner's forward."""
    rows: torch.Tensor        # (K,) rows of the call that take image features
    features: torch.Tensor    # (K, C)
    ropes: list[tuple[int, torch.Tensor]]  # (first row, (3, n) positions) per piece with images


def placement(items: Sequence[tuple[int, int, int, ImagePrompt | None]]) -> Placement | None:
    """For pieces (first row in the call, first token position, token count, images): what goes where; None when
    no piece has images."""
    rows, feats, ropes = [], [], []
    for row, start, n, im in items:
        if im is None:
            continue
        ropes.append((row, im.rope(start, start + n)))
        inside = (im.rows >= start) & (im.rows < start + n)
        rows.append(im.rows[inside] - start + row)
        feats.append(im.features[inside])
    if not ropes:
        return None
    return Placement(torch.cat(rows), torch.cat(feats), ropes)


class ImageTextRunner(HybridRunner):
    """The hybrid runner on an image-text Qwen3.5 model (a vision tower and the multimodal rotary): image
    features at the placeholders, rotary from three positions per row."""

    families = ("qwen3_5 and qwen3_5_moe (image-text prompts)",)  # type: ignore[assignment]

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        return (HybridRunner.accepts(model) and isinstance(model, ImageTextForCausalLM)
                and model.visual is not None and isinstance(model.model.rotary_emb, MRotaryEmbedding))

    def _setup(self) -> None:
        super()._setup()
        # each rotary column's axis (0 time, 1 height, 2 width), as MRotaryEmbedding interleaves its sections
        rotary: Any = self.backbone.rotary_emb
        assert self.cos is not None  # (a multimodal rotary: `accepts`)
        sections, half = rotary.sections, self.cos.shape[-1] // 2
        axis = [1 if f % 3 == 1 and f < 3 * sections[1] else 2 if f % 3 == 2 and f < 3 * sections[2] else 0
                for f in range(half)]
        self.axis = torch.tensor(axis + axis, device=self.cos.device)
        self.columns = torch.arange(2 * half, device=self.cos.device)
        self._scoring = threading.local()

    def rope3(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, D) for (3, N) positions: column c of row n is the table's at position positions[axis[c], n]
        (text rows, equal on all axes, get the table's row itself)."""
        at = positions[self.axis].T  # (N, D)
        assert self.cos is not None and self.sin is not None
        return self.cos[at, self.columns], self.sin[at, self.columns]

    def _step_extras(self, pieces: list[Piece], rows: dict[int, tuple[int, int]], pool) -> tuple:
        items = [(rows[j][0], p.start, len(p.ids), getattr(p, "images", None)) for j, p in enumerate(pieces)]
        return (*super()._step_extras(pieces, rows, pool), placement(items))

    def _packed_extras(self, bounds: list[tuple[int, int]]) -> tuple:
        images = getattr(self._scoring, "images", None) or [None] * len(bounds)
        if len(images) != len(bounds):
            raise KilnError(f"token_logps: {len(bounds)} sequences but {len(images)} image entries")
        return (*super()._packed_extras(bounds), placement([(s, 0, e - s, im) for (s, e), im in zip(bounds, images)]))

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, kv, states=None, where: Placement | None = None
             ) -> torch.Tensor:
        if where is None:  # text alone: the hybrid runner's forward
            return super()._run(ids, positions, kv, states)
        embed: Any = self.backbone.embed_tokens
        x = embed(ids)  # (N, C)
        x = x.index_put((where.rows,), where.features.to(x.dtype))
        pos3 = positions.expand(3, -1).clone()
        for row, rope in where.ropes:
            pos3[:, row:row + rope.shape[1]] = rope
        cos, sin = self.rope3(pos3)
        for i in range(self.num_layers):
            x = self._delta_layer(i, x, states) if self.delta[i] else self._attn_layer(i, x, cos, sin, kv)
        return x

    @contextmanager
    def scoring(self, images: list[ImagePrompt | None]):
        """Within it, the scoring forward (`dense_many`) of this thread places `images[i]` in sequence i."""
        self._scoring.images = images
        try:
            yield
        finally:
            self._scoring.images = None


# a runner more specific than the hybrid one (which accepts these models too, for text prompts): matched first
RUNNERS.insert(0, ImageTextRunner)


def token_logps(model: nn.Module, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                prompt_inputs: Sequence[dict | None], *, block_size: int = 16, temperature: float = 1.0
                ) -> list[torch.Tensor]:
    """kiln.engine.score.token_logps with images: sequence i's images (`prompt_inputs[i]`, None for none) sit
    at the placeholders of its first starts[i] tokens (its prompt; what follows is text, as the engine generates
    it). The tower runs once per distinct image of the call, without gradient (the features are inputs here: a
    gradient reaches the text model, not the tower). The same bits as the engine's log-probs."""
    from kiln.engine.score import runner_for
    from kiln.engine.score import token_logps as score

    if len(prompt_inputs) != len(sequences):
        raise KilnError(f"token_logps: {len(sequences)} sequences but {len(prompt_inputs)} prompt_inputs")
    runner = runner_for(model)
    if any(prompt_inputs) and not isinstance(runner, ImageTextRunner):
        prompt_images(model, [], {}, ImageFeatures())  # raises: the model takes no images
    cache = ImageFeatures()
    images: list[ImagePrompt | None] = [prompt_images(model, [int(t) for t in ids[:s]], inp, cache) if inp else None
              for ids, s, inp in zip(sequences, starts, prompt_inputs)]
    if not isinstance(runner, ImageTextRunner):
        return score(model, sequences, starts, block_size=block_size, temperature=temperature)
    with runner.scoring(images):
        return score(model, sequences, starts, block_size=block_size, temperature=temperature)
