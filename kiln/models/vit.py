"""ViT (Dosovitskiy et al.): an image as a sequence of patches through a pre-LayerNorm encoder.

  pixels (B, C, H, W) -> Conv2d patches (B, N, D) -> [CLS] + patches -> + learned positions (bicubic-
  resampled to the image's patch grid with `interpolate_pos_encoding`) -> pre-norm encoder layers
  (x + attn(ln(x)); x + mlp(ln(x))) -> final LayerNorm -> base: + pooler (dense + tanh on [CLS]);
  image classification: classifier on [CLS].

Deltas from the text encoders: pixels instead of token ids, pre-norm layers (BERT is post-norm), no
padding mask. Module names are transformers 5's in-memory ones (q_proj, mlp.fc1); the key map
renames them to the on-disk `encoder.layer.{i}.attention.attention.query` layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError, KilnError
from kiln.models.common.activations import activation
from kiln.models.common.attention import SelfAttention
from kiln.models.config import FamilyConfig
from kiln.models.heads import ForSequenceClassification, ModelOutput
from kiln.models.keymap import KeyMap
from kiln.models.pretrained import Family, PreTrainedModel, TaskSpec, Tiny
from kiln.models.tasks import BASE, IMAGE_CLASSIFICATION


@dataclass
class ViTConfig(FamilyConfig):
    model_type = "vit"

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    encoder_stride: int = 16
    pooler_output_size: int | None = None
    pooler_act: str = "tanh"
    tie_word_embeddings: bool = False

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                              f"({self.num_attention_heads})")
        if self.image_size % self.patch_size:
            raise ConfigError(f"{source}: image_size ({self.image_size}) must be a multiple of patch_size "
                              f"({self.patch_size})")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("tie_word_embeddings", None)  # transformers' ViTConfig has none
        return out


class PatchEmbeddings(nn.Module):
    """The patches' projection, under HF's name (`embeddings.patch_embeddings.projection`)."""

    def __init__(self, c: ViTConfig):
        super().__init__()
        self.projection = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)


class ViTEmbeddings(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.patch_size, self.image_size, self.num_channels = c.patch_size, c.image_size, c.num_channels
        num_patches = (c.image_size // c.patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, num_patches + 1, c.hidden_size))
        self.patch_embeddings = PatchEmbeddings(c)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.trunc_normal_(self.cls_token, 0.0, std)
        nn.init.trunc_normal_(self.position_embeddings, 0.0, std)
        nn.init.normal_(self.patch_embeddings.projection.weight, 0.0, std)
        bias = self.patch_embeddings.projection.bias
        if bias is not None:  # (built with one: Conv2d's default)
            nn.init.zeros_(bias)

    def positions(self, tokens: int, height: int, width: int) -> torch.Tensor:
        """The learned table, or (another grid) its patch part resampled bicubically to height x width patches."""
        table = self.position_embeddings
        n = table.shape[1] - 1
        if tokens - 1 == n and height == width:
            return table
        side, dim = int(n ** 0.5), table.shape[-1]
        grid = table[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(height // self.patch_size, width // self.patch_size), mode="bicubic",
                             align_corners=False)
        return torch.cat((table[:, :1], grid.permute(0, 2, 3, 1).view(1, -1, dim)), dim=1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        B, C, H, W = pixel_values.shape
        if self.num_channels != C:
            raise KilnError(f"pixel_values has {C} channels; this model takes {self.num_channels}")
        if not interpolate_pos_encoding and (self.image_size, self.image_size) != (H, W):
            raise KilnError(f"input image size ({H}*{W}) doesn't match the model's ({self.image_size}*"
                            f"{self.image_size}); pass interpolate_pos_encoding=True to resample the positions")
        x = self.patch_embeddings.projection(pixel_values).flatten(2).transpose(1, 2)  # (B, N, D)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = x + (self.positions(x.shape[1], H, W) if interpolate_pos_encoding else self.position_embeddings)
        return self.dropout(x)


class ViTMLP(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTLayer(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_probs_dropout_prob)
        if not c.qkv_bias:  # ViT: qkv_bias switches q/k/v biases only; o_proj keeps its own
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(self.attention, name, nn.Linear(c.hidden_size, c.hidden_size, bias=False))
        self.layernorm_before = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = ViTMLP(c)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.attention(self.layernorm_before(x), None)) + x  # pre-norm
        return self.dropout(self.mlp(self.layernorm_after(x))) + x


class ViTPooler(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.pooler_output_size or c.hidden_size)
        self.act = activation(c.pooler_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden[:, 0]))


class ViTBackbone(nn.Module):
    """pixels (B, C, H, W) -> (last hidden state (B, 1 + N, D), pooled (B, D) or None)."""

    def __init__(self, c: ViTConfig, pooler: bool):
        super().__init__()
        self.embeddings = ViTEmbeddings(c)
        self.layers = nn.ModuleList(ViTLayer(c) for _ in range(c.num_hidden_layers))
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.pooler = ViTPooler(c) if pooler else None

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False):
        x = self.embeddings(pixel_values.to(self.embeddings.patch_embeddings.projection.weight.dtype),
                            interpolate_pos_encoding)
        for layer in self.layers:
            x = layer(x)
        x = self.layernorm(x)
        return x, (self.pooler(x) if self.pooler is not None else None)


class _PixelInputs(PreTrainedModel):
    """What ViT task models share: batches of pixels for verify-export (the model's size and a larger one)."""

    config: ViTConfig

    def verify_batches(self, text_batches: list[dict]) -> list[dict]:
        c, g = self.config, torch.Generator().manual_seed(0)
        return [{"pixel_values": torch.randn(2, c.num_channels, c.image_size, c.image_size, generator=g)},
                {"pixel_values": torch.randn(3, c.num_channels, c.image_size + c.patch_size, c.image_size, generator=g),
                 "interpolate_pos_encoding": True}]


class ViTModel(_PixelInputs, PreTrainedModel):
    def __init__(self, model: ViTBackbone):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> ModelOutput:
        hidden, pooled = self.model(pixel_values, interpolate_pos_encoding)
        return ModelOutput(last_hidden_state=hidden, pooler_output=pooled)


class ViTForImageClassification(_PixelInputs, ForSequenceClassification):
    """classifier on the final [CLS] state; the loss by problem_type as for sequence classification."""

    def __init__(self, model: ViTBackbone, dim: int, num_labels: int):
        super().__init__(model, nn.Linear(dim, num_labels))

    def forward(self, pixel_values: torch.Tensor,  # type: ignore[override]  # pixels in, not token ids
                labels: torch.Tensor | None = None, interpolate_pos_encoding: bool = False) -> ModelOutput:
        hidden, _ = self.model(pixel_values, interpolate_pos_encoding)
        logits = self.head(hidden[:, 0])  # (B, num_labels)
        return ModelOutput(logits=logits, loss=None if labels is None else self.loss(logits, labels),
                           last_hidden_state=hidden)


L = "encoder.layer.{}"
BASE_KEYS = KeyMap([
    ("embeddings", "embeddings"),
    ("layers.{}.attention.q_proj", f"{L}.attention.attention.query"),
    ("layers.{}.attention.k_proj", f"{L}.attention.attention.key"),
    ("layers.{}.attention.v_proj", f"{L}.attention.attention.value"),
    ("layers.{}.attention.o_proj", f"{L}.attention.output.dense"),
    ("layers.{}.mlp.fc1", f"{L}.intermediate.dense"),
    ("layers.{}.mlp.fc2", f"{L}.output.dense"),
    ("layers.{}.layernorm_before", f"{L}.layernorm_before"),
    ("layers.{}.layernorm_after", f"{L}.layernorm_after"),
    ("layernorm", "layernorm"),
    ("pooler.dense", "pooler.dense"),
])


def tiny_batches(head: str, config: Any) -> list[dict]:
    """The parity harness's inputs: pixels at the model's size and, resampling the positions, a larger one;
    labels for the classification head."""
    g = torch.Generator().manual_seed(3)
    s, p, n = config.image_size, config.patch_size, getattr(config, "num_labels", 2)
    out: list[dict[str, Any]] = [  # forward kwargs: tensors and flags{"pixel_values": torch.randn(2, 3, s, s, generator=g)},
           {"pixel_values": torch.randn(3, 3, s + 2 * p, s + p, generator=g), "interpolate_pos_encoding": True}]
    if head == IMAGE_CLASSIFICATION:
        out += [{**b, "labels": torch.randint(0, n, (b["pixel_values"].shape[0],), generator=g)} for b in out]
    return out


TINY = Tiny(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=16,
                 patch_size=4), specials={}, inputs=tiny_batches)

FAMILY = Family(
    model_type="vit",
    config_cls=ViTConfig,
    hf_prefix="vit",
    base_keys=BASE_KEYS,
    tasks={
        BASE: TaskSpec("ViTModel", lambda c: ViTModel(ViTBackbone(c, pooler=True))),
        IMAGE_CLASSIFICATION: TaskSpec("ViTForImageClassification",
                                       lambda c: ViTForImageClassification(ViTBackbone(c, pooler=False),
                                                                           c.hidden_size, c.num_labels),
                                       KeyMap([("head", "classifier")])),
    },
    tiny=TINY,
)
