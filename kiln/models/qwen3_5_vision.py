"""The Qwen3.5 / Qwen3.6 vision tower and what ties it to the language model.

  patches (N, C*Tp*P*P) -> Conv3d over (temporal, height, width) patches -> + learned positions
  (a square table resampled bilinearly, corners aligned, to each image's grid) -> ViT blocks
  (pre-LayerNorm, 2-D rotary on h/w, attention within each image frame) -> patch merger (LayerNorm,
  each 2x2 block of patches concatenated, MLP to the text width) -> (N / 4, C_text)

Patches come in merge-block order (the processor's patchify lays every 2x2 block together), so
the positions and the merge read them that way. The language model sees the merged features at
the image placeholder tokens and multimodal rotary positions (time, height, width) from
`image_positions`: text runs count on, an image's tokens take (start, start + row, start + col)
and the text after it resumes at start + max(rows, cols). Qwen3.5 has no deepstack.
Module and tensor names are transformers' (`model.visual.*`), so the key map is one line.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.data.images import QwenImageProcessor
from kiln.data.sft_images import ImageTokens
from kiln.errors import ConfigError, KilnError
from kiln.hub.config import write_json_atomic
from kiln.models.common.activations import activation
from kiln.models.common.causal_lm import CausalLMOutput
from kiln.models.common.config import text_sizes
from kiln.models.common.decoder import segment_ids
from kiln.models.common.rope import rotate_half
from kiln.models.qwen3_next import HybridForCausalLM

if TYPE_CHECKING:
    from kiln.models.qwen3_5 import ImageTextConfig

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values, as transformers' processors write them


@dataclass
class VisionConfig:
    """config.json's `vision_config` (transformers' defaults for keys it omits)."""
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "config.json") -> VisionConfig:
        data = dict(data or {})
        rope = data.pop("rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: vision_config.rope_parameters.rope_type must be 'axial', "
                              f"got {rope.get('rope_type')!r}")
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in data.items() if k in names}, rope_theta=float(rope.get("rope_theta", 10000.0)))
        cfg.validate(source)
        return cfg

    def validate(self, source: str) -> None:
        for f in fields(self):  # every whole size of the tower >= 1 (a 0 fails in a modulo, a -1 deep in a conv)
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{source}: vision_config.{f.name} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{source}: vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_heads ({self.num_heads})")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(f"{source}: vision_config.num_position_embeddings ({self.num_position_embeddings}) "
                              f"must be a square (a side x side table)")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


# ---- grid bookkeeping (no weights) --------------------------------------------------------------
def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, col) in its frame, patches in merge-block order (block row, block col, row in
    block, col in block), frames after one another: two (N,) long tensors."""
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rows.append(r.transpose(1, 2).flatten().repeat(t))  # (h/m, w/m, m, m): block-major
        cols.append(c.transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows).to(grid_thw.device), torch.cat(cols).to(grid_thw.device)


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1) into a `side`-long table for positions `index` of an axis of `size`
    (corners aligned: 0 -> 0, size - 1 -> side - 1) and their weights, clamped at the border: (N, 2) each."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the flattened (side x side) position table and weights that resample it to every
    image's grid: (N, 4) each, patches in merge-block order."""
    rows, cols = patch_rows_cols(grid_thw, merge)
    counts = grid_thw.prod(-1)
    h_taps, h_w = _taps(rows, torch.repeat_interleave(grid_thw[:, 1], counts), side)
    w_taps, w_w = _taps(cols, torch.repeat_interleave(grid_thw[:, 2], counts), side)
    return ((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4),
            (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))


# ---- the tower ------------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """Each flattened patch (C * Tp * P * P,) through a Conv3d whose kernel is the patch: (N, C_vis)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.shape = (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, 0.0, std)
        assert self.proj.bias is not None, "the patch conv is built with a bias"
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return self.proj(x.view(-1, *self.shape).to(w.dtype)).view(-1, w.shape[0])


class VisionAttention(nn.Module):
    """Full attention within each frame (`cu_seqlens` bounds), rotary on q and k in float32."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scaling = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).reshape(N, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)  # (N, H, D) each
        cos, sin = (t.unsqueeze(-2).float() for t in rope)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, N, D)
        outs = [F.scaled_dot_product_attention(qi, ki, vi, scale=self.scaling).transpose(1, 2).contiguous()
                for qi, ki, vi in zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))]
        return self.proj(torch.cat(outs, dim=1).reshape(N, -1).contiguous())  # (N, C)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, dim, bias=True)
        self.act_fn = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c.hidden_size, c.num_heads)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side -> MLP -> the text width."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.merged = c.hidden_size * c.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class VisionModel(nn.Module):
    """pixel patches (N, C*Tp*P*P) and grid_thw (images, 3) -> merged features (N / merge^2, out_hidden_size)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.spatial_merge_size = c.spatial_merge_size
        self.side = math.isqrt(c.num_position_embeddings)
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def rotary(self, grid_thw: torch.Tensor, dtype_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, head_dim): the first half of each head turns with the patch row, the second with its column."""
        spatial = self.config.hidden_size // self.config.num_heads // 2  # head_dim / 4 frequencies per axis
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        rows, cols = patch_rows_cols(grid_thw, self.spatial_merge_size)
        freqs = torch.stack([rows, cols], -1)[..., None].float() * inv_freq.to(dtype_like.device)  # (N, 2, D/4)
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)  # (N, D)
        return angles.cos(), angles.sin()

    def check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        c, m = self.config, self.spatial_merge_size
        if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
            raise KilnError(f"image_grid_thw must be (images, 3), got shape {tuple(grid_thw.shape)}")
        if bool(((grid_thw[:, 1:] % m) != 0).any()):
            raise KilnError(f"image_grid_thw heights and widths must be multiples of spatial_merge_size ({m}): "
                            f"{grid_thw.tolist()}")
        want = (int(grid_thw.prod(-1).sum()), c.patch_dim)
        if tuple(pixel_values.shape) != want:
            raise KilnError(f"pixel_values has shape {tuple(pixel_values.shape)} but image_grid_thw "
                            f"{grid_thw.tolist()} asks for {want} (patches x channels*temporal*patch*patch)")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        self.check(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # (N, C)
        index, weight = position_taps(grid_thw, self.side, self.spatial_merge_size)
        x = x + (self.pos_embed(index) * weight[:, :, None]).sum(1).to(x.dtype)
        rope = self.rotary(grid_thw, x)
        lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()  # per frame
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)  # (N / m^2, out)


# ---- the language model's side ------------------------------------------------------------------
def token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int | None) -> torch.Tensor:
    """mm_token_type_ids from the placeholders: 1 at image tokens, 2 at video tokens, else 0."""
    types = (input_ids == image_token_id).long() * IMAGE
    if video_token_id is not None:
        types = types + (input_ids == video_token_id).long() * VIDEO
    return types


def _run_positions(types: list[int], grids, merge: int, where: str, images: int) -> torch.Tensor:
    """(3, n) positions of one sample's tokens from 0, each image taking the next grid of `grids`."""
    parts, pos = [], 0
    for kind, run in itertools.groupby(types):
        n = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(pos, pos + n).expand(3, -1))
            pos += n
            continue
        if kind != IMAGE:
            raise KilnError(f"{where}: video tokens (mm_token_type_ids == {kind}) are not supported; images only")
        try:
            t, h, w = next(grids)
        except StopIteration:
            raise KilnError(f"{where}: more image runs in input_ids than image_grid_thw has images "
                           f"({images})") from None
        gt, gh, gw = t, h // merge, w // merge
        if n != gt * gh * gw:
            raise KilnError(f"{where}: an image run of {n} placeholder tokens but its grid {[t, h, w]} "
                            f"gives {gt * gh * gw} features")
        tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def image_positions(input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor,
                    attention_mask: torch.Tensor | None, merge: int,
                    packed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary positions (3, B, T) (padding at 0) and each row's offset (B, 1) between its next
    position and its length, for decoding on. `packed` (B, T): a packed row's text positions; each sample
    (where they restart) counts from 0 on its own and takes the next images (the offset is then the last
    sample's)."""
    B, T = input_ids.shape
    positions = torch.zeros(3, B, T, dtype=input_ids.dtype, device=input_ids.device)
    grids = iter(image_grid_thw.tolist())
    deltas = []
    for b in range(B):
        keep = attention_mask[b].bool() if attention_mask is not None else torch.ones(T, dtype=torch.bool,
                                                                                        device=input_ids.device)
        types = mm_token_type_ids[b][keep].tolist()
        starts = [0] + ([] if packed is None else
                        [i for i, step in enumerate(torch.diff(packed[b]).tolist(), 1) if step != 1]) + [len(types)]
        row = torch.cat([_run_positions(types[s:e], grids, merge, f"row {b}", len(image_grid_thw))
                         for s, e in itertools.pairwise(starts)], dim=1).to(positions)
        positions[:, b, keep] = row
        last = row[:, starts[-2]:]
        deltas.append((int(last.max()) + 1 if last.numel() else 0) - last.shape[1])
    if next(grids, None) is not None:
        raise KilnError(f"image_grid_thw has {len(image_grid_thw)} images but input_ids hold fewer image runs")
    return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


class ImageTextForCausalLM(HybridForCausalLM):
    """transformers' `Qwen3_5(Moe)ForConditionalGeneration`: the hybrid decoder and LM head (`model`,
    `lm_head`) with the vision tower (`visual`, HF `model.visual`). Without images it is the text model.

    Images come as the processor gives them: `pixel_values` (patches, C*Tp*P*P), `image_grid_thw`
    (images, 3), and one `image_token_id` placeholder per merged patch in `input_ids`;
    `mm_token_type_ids` is read from the placeholders when not given. The rotary offset of the
    prompt's last image (`rope_deltas`) carries on into decoding steps that come with a cache.
    """
    @property
    def takes_images(self) -> bool:
        """kiln.models.AutoModelForImageTextToText accepts it when it has a tower."""
        return self.visual is not None

    touch_every_parameter = False  # the Trainer's: a batch without images still reaches the tower (times 0)

    @property
    def may_leave_parameters_unused(self) -> bool:
        """A batch without images leaves a trainable tower without gradients (what distributed reductions wait on)."""
        return self.visual is not None and any(p.requires_grad for p in self.visual.parameters())

    def touch_tower(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The token embeddings plus 0 x the tower's output for one blank merge block: the same values, and a
        zero gradient for every tower parameter (`touch_every_parameter`, on batches without images)."""
        embeds = self._embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        tower = self.tower
        m, w = tower.spatial_merge_size, tower.patch_embed.proj.weight
        blank = tower(w.new_zeros(m * m, tower.config.patch_dim),
                            torch.tensor([[1, m, m]], device=w.device))  # (1, C)
        return embeds + 0 * blank.sum().to(embeds.dtype)

    def __init__(self, model: nn.Module, hidden_size: int, vocab_size: int, tied: bool, vision: VisionConfig | None,
                 image_token_id: int, video_token_id: int | None = None):
        super().__init__(model, hidden_size, vocab_size, tied)
        # no vision_config (a model built from a text config): the text model alone, no tower
        self.visual = VisionModel(vision) if vision is not None else None
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.rope_deltas: torch.Tensor | None = None

    image_processor: QwenImageProcessor | None = None  # the one the model was trained with (save_pretrained writes it)
    config: ImageTextConfig  # the image-text families' (kiln.models.qwen3_5): the text model's, plus `outer`

    @property
    def tower(self) -> VisionModel:
        """The vision tower; a KilnError where the model has none."""
        if self.visual is None:
            raise KilnError("this model has no vision tower (its config.json has no vision_config): it takes no images")
        return self.visual

    def _embed_tokens(self, input_ids: torch.Tensor | None) -> torch.Tensor:
        embed_tokens = self.model.embed_tokens
        assert isinstance(embed_tokens, nn.Module), "the backbone's token embedding"
        return embed_tokens(input_ids)

    def save_pretrained(self, path, max_shard_bytes: int | None = None, save_tokenizer: bool = True):
        """The HF directory, with preprocessor_config.json when an image processor was set (`image_processor`:
        the one the model was trained with), so generation and transformers read images the same way."""
        out = super().save_pretrained(path, max_shard_bytes, save_tokenizer)
        processor = getattr(self, "image_processor", None)
        if processor is not None:
            write_json_atomic(out / "preprocessor_config.json", processor.to_dict())
        return out

    def example_image_batch(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Two random images of different grids in a left-padded batch of two rows (text, vision start, the
        image's placeholders, vision end, text), the processor's keys: what verify-export feeds both models."""
        c = self.tower.config
        m, g = c.spatial_merge_size, torch.Generator().manual_seed(seed)
        grids = torch.tensor([[1, 2 * m, 2 * m], [1, 3 * m, 4 * m]])
        pixels = torch.randn(int(grids.prod(-1).sum()), c.patch_dim, generator=g)
        vocab = text_sizes(self.config).vocab_size
        start, end = self.config.outer.get("vision_start_token_id"), self.config.outer.get("vision_end_token_id")
        text = [i for i in range(4, vocab) if i not in {self.image_token_id, self.video_token_id, start, end}]
        rows = []
        for (t, h, w), (pre, post) in zip(grids.tolist(), [(3, 5), (2, 3)]):
            pick = [text[int(j)] for j in torch.randint(len(text), (pre + post,), generator=g)]
            marks = [x for x in (start,) if x is not None], [x for x in (end,) if x is not None]
            rows.append(pick[:pre] + marks[0] + [self.image_token_id] * (t * h * w // m ** 2) + marks[1] + pick[pre:])
        T = max(map(len, rows))
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, T - len(r):], mask[b, T - len(r):] = torch.tensor(r), 1
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grids,
                "mm_token_type_ids": token_types(ids, self.image_token_id, self.video_token_id) * mask}

    def image_tokens(self, processor: QwenImageProcessor | None = None, model_dir: Any = None,
                     root: Any = ".") -> ImageTokens:
        """The processor (given, else `model_dir`'s preprocessor_config.json, else this tower's patch sizes) and
        this model's vision tokens as its tokenizer writes them: what image-text chats are encoded with."""
        if self.visual is None:
            raise KilnError("this model has no vision tower (its config.json has no vision_config): it takes no images")
        vision = self.config.outer.get("vision_config") or {}
        if processor is None:
            c = self.visual.config
            processor = (QwenImageProcessor.for_model(model_dir, vision) if model_dir is not None else
                         QwenImageProcessor(patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
                                            merge_size=c.spatial_merge_size))

        def text(key: str, token_id: int | None) -> str | None:
            token = None if token_id is None or self.tokenizer is None else self.tokenizer.id_to_token(token_id)
            if token_id is not None and token is None:
                raise ConfigError(f"the tokenizer has no token with id {token_id} ({key} of the model's config): "
                                  f"the tokenizer and the model do not belong together")
            return token

        start = self.config.outer.get("vision_start_token_id")
        image = text("image_token_id", self.image_token_id)
        assert image is not None, "text() gives the token of an id, or raises"
        return ImageTokens(processor, self.image_token_id, image, text("vision_start_token_id", start),
                           text("vision_end_token_id", self.config.outer.get("vision_end_token_id")), start, Path(root))

    def image_prompt(self, images: list, processor: Any = None, model_dir: Any = None
                     ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """For images (paths or PIL images): the prompt ids that stand for them (per image: vision start, one
        placeholder per merged patch, vision end) and the processor's pixel inputs. `processor` defaults to the
        Qwen-VL processor of `model_dir`'s preprocessor_config.json, else on this tower's patch sizes."""
        if self.visual is None:
            raise KilnError("this model has no vision tower (its config.json has no vision_config): it takes no images")
        c = self.visual.config
        if processor is None and model_dir is not None:
            processor = QwenImageProcessor.for_model(model_dir, self.config.outer.get("vision_config"))
        processor = processor or QwenImageProcessor(patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
                                                    merge_size=c.spatial_merge_size)
        inputs = processor(images)
        start, end = self.config.outer.get("vision_start_token_id"), self.config.outer.get("vision_end_token_id")
        ids: list[int] = []
        for grid in inputs["image_grid_thw"].tolist():
            ids += ([start] if start is not None else []) + [self.image_token_id] * processor.tokens_for(grid) + (
                [end] if end is not None else [])
        return ids, inputs

    def verify_batches(self, text_batches: list[dict]) -> list[dict]:
        """verify-export's inputs: the text batches and (with a vision tower) an image batch."""
        return text_batches + ([self.example_image_batch()] if self.visual is not None else [])

    def embed_images(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None, pixel_values: torch.Tensor,
                     image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C) with the images' merged features at their placeholders, in order."""
        embeds = self._embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        tower = self.tower
        features = tower(pixel_values.to(tower.patch_embed.proj.weight.dtype), image_grid_thw)
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise KilnError(f"input_ids hold {int(mask.sum())} image placeholder tokens (id {self.image_token_id}) "
                            f"but the images give {features.shape[0]} features (image_grid_thw "
                            f"{image_grid_thw.tolist()}, merge {tower.spatial_merge_size})")
        return embeds.masked_scatter(mask.unsqueeze(-1).to(embeds.device), features.to(embeds.device, embeds.dtype))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache: Any = None, logits_to_keep: int = 0, output_router_logits: bool | None = None,
                targets: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None,
                mm_token_type_ids: torch.Tensor | None = None) -> CausalLMOutput:
        decoding = cache is not None and len(cache) > 0
        if image_grid_thw is not None and len(image_grid_thw) == 0:  # a batch of text rows from image-text data
            pixel_values = image_grid_thw = None
        if (pixel_values is not None or image_grid_thw is not None) and self.visual is None:
            raise KilnError("this model has no vision tower (its config.json has no vision_config): it takes no images")
        if pixel_values is not None or image_grid_thw is not None:
            if input_ids is None or image_grid_thw is None:
                raise KilnError("images need input_ids (their placeholders) and image_grid_thw beside pixel_values")
            if pixel_values is not None:
                inputs_embeds = self.embed_images(input_ids, inputs_embeds, pixel_values, image_grid_thw)
            if position_ids is None or (not decoding and position_ids.dim() == 2):
                types = mm_token_type_ids if mm_token_type_ids is not None else token_types(
                    input_ids, self.image_token_id, self.video_token_id)
                # packed rows (positions restarting, no padding mask): each sample's images from its own start,
                # and the text positions go along as row 0 so attention and the DeltaNet state stay per sample
                packed = position_ids if (position_ids is not None and attention_mask is None and cache is None
                                          and segment_ids(position_ids) is not None) else None
                mrope, self.rope_deltas = image_positions(input_ids, types, image_grid_thw, attention_mask,
                                                          self.tower.spatial_merge_size, packed)
                position_ids = mrope if packed is None else torch.cat([packed[None], mrope])  # (3 or 4, B, T)
            if inputs_embeds is not None:
                input_ids = None
        elif self.touch_every_parameter and self.training and torch.is_grad_enabled() and self.visual is not None:
            inputs_embeds, input_ids = self.touch_tower(input_ids, inputs_embeds), None
            self.rope_deltas = None
        elif decoding and self.rope_deltas is not None and position_ids is not None and position_ids.dim() == 2:
            position_ids = (position_ids + self.rope_deltas.to(position_ids.device))[None]  # (1, B, T): all axes
        elif not decoding:
            self.rope_deltas = None  # a new text-only prompt: no image offset
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, labels=labels, cache=cache, logits_to_keep=logits_to_keep,
                               output_router_logits=output_router_logits, targets=targets)
