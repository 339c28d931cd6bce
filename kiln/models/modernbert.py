"""ModernBERT: a pre-LN encoder with rotary positions and alternating global / local attention.

Choices: no position or token-type embeddings (rope in attention, a theta per layer type); word
embeddings -> LayerNorm; each layer h = x + attn(norm(x)), y = h + mlp(norm(h)), layer 0 without
the attention norm; fused qkv; local layers see |i - j| <= local_attention / 2; GeGLU MLP
(one fused input projection, halves = activated input and gate); a final LayerNorm; biases and
norm biases off unless the config turns them on. Heads put a dense -> act -> norm transform before
the classifier or the (tied) decoder; sequence classification pools the CLS token or the mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError
from kiln.models import bert
from kiln.models.common.activations import activation
from kiln.models.common.attention import bidirectional_mask, sliding_window_mask
from kiln.models.common.encoder import Embeddings
from kiln.models.common.rope import RotaryEmbedding, apply_rope, rope_parameters
from kiln.models.common.typed import members
from kiln.models.config import FamilyConfig
from kiln.models.heads import (
    BaseModel,
    ForMaskedLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    ModelOutput,
)
from kiln.models.keymap import KeyMap
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.tasks import BASE, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
_LEGACY_THETA = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


@dataclass
class ModernBertConfig(FamilyConfig):
    model_type = "modernbert"

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int | None = 50283
    attention_bias: bool = False
    attention_dropout: float = 0.0
    # Either field may be absent: older configs say global_attn_every_n_layers and global/local_rope_theta
    layer_types: list[str] | None = None
    rope_parameters: dict[str, Any] | None = None
    local_attention: int = 128
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_dropout: float = 0.0
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    sparse_prediction: bool = False
    sparse_pred_ignore_index: int = IGNORE_INDEX

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_types(self) -> list[str]:
        """Each layer's type: `layer_types`, else every n-th layer (from 0) global, the rest local."""
        if self.layer_types is not None:
            return list(self.layer_types)
        every = self.extra.get("global_attn_every_n_layers", 3)
        return ["sliding_attention" if i % every else "full_attention" for i in range(self.num_hidden_layers)]

    @property
    def window(self) -> int:
        """Half the local window: a local layer's query i sees keys j with |i - j| <= window."""
        return self.local_attention // 2

    def rope(self, layer_type: str, source: str = "config.json") -> dict[str, Any]:
        """The rope dict of one layer type, filled from the legacy theta keys as transformers fills it."""
        given = (self.rope_parameters or {}).get(layer_type)
        params = dict(given) if given else {"rope_type": "default"}
        if self.extra.get("rope_scaling"):  # a legacy key transformers merges into both layer types
            params.update(self.extra["rope_scaling"])
        params.setdefault("rope_theta", self.extra.get(_LEGACY_THETA[layer_type], _DEFAULT_THETA[layer_type]))
        return rope_parameters(params, {}, self.max_position_embeddings, source=f"{source} ({layer_type})")

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        every = self.extra.get("global_attn_every_n_layers", 3)
        if self.layer_types is None and (not isinstance(every, int) or every < 1):
            raise ConfigError(f"{source}: global_attn_every_n_layers must be a positive integer, got {every!r}")
        types = self.attention_types
        if len(types) != self.num_hidden_layers:
            raise ConfigError(f"{source}: layer_types has {len(types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"{source}: layer_types {bad} not supported; choose from {', '.join(LAYER_TYPES)}")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ConfigError(f"{source}: classifier_pooling must be 'cls' or 'mean', got {self.classifier_pooling!r}")
        if self.local_attention < 2:
            raise ConfigError(f"{source}: local_attention (the local window) must be at least 2, "
                              f"got {self.local_attention}")
        for layer_type in set(types):
            self.rope(layer_type, source)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("layer_types", "rope_parameters"):  # unset: leave transformers to derive them as kiln did
            if out.get(key, 0) is None:
                del out[key]
        return out


# ---- blocks ------------------------------------------------------------------------------------
class ModernBertAttention(nn.Module):
    """Fused qkv -> rope (in float32, as HF) -> SDPA under the layer's mask -> o_proj -> dropout."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.scaling = self.head_dim**-0.5
        self.dropout = c.attention_dropout
        self.qkv_proj = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias)
        self.out_dropout = nn.Dropout(c.attention_dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # One projection split by a view, not three Linears: HF's GEMM shape and its strided q/k/v
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(dim=2)  # (B, T, H, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        dtype = q.dtype
        q, k = apply_rope(q.float(), k.float(), *rope)  # ModernBERT: rotates in float32 whatever the dtype
        q, k = q.to(dtype), k.to(dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           scale=self.scaling)
        y = y.transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()  # (B, T, C)
        return self.out_dropout(self.o_proj(y))


class GeGLU(nn.Module):
    """down(dropout(act(a) * g)) with [a, g] = up(x): one fused input projection of twice the width."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.act = activation(c.hidden_activation)
        self.dropout = nn.Dropout(c.mlp_dropout)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.down_proj(self.dropout(self.act(a) * g))


class ModernBertLayer(nn.Module):
    def __init__(self, c: ModernBertConfig, index: int):
        super().__init__()
        self.attention_type = c.attention_types[index]
        # ModernBERT: layer 0 reads the embedding LayerNorm's output directly, no attention norm
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias) if index else nn.Identity()
        self.attn = ModernBertAttention(c)
        self.mlp_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)
        self.mlp = GeGLU(c)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), mask, rope)
        return h + self.mlp(self.mlp_norm(h))


IsFresh = Callable[[torch.Tensor], bool]


def _everything(t: torch.Tensor) -> bool:
    return True


def _trunc_normal(linear: nn.Linear | nn.Embedding, std: float, cutoff: float, is_fresh: IsFresh = _everything) -> None:
    """transformers' ModernBERT init of one Linear: weight ~ N(0, std) cut at +-cutoff * std (a tensor a load filled:
    untouched, no draw)."""
    if is_fresh(linear.weight):
        nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


def _out_std(c: ModernBertConfig) -> float:
    return c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)


def _trunc_classifier(linear: nn.Linear, c: ModernBertConfig, is_fresh: IsFresh) -> None:
    _trunc_normal(linear, c.hidden_size**-0.5, c.initializer_cutoff_factor, is_fresh)


class ModernBertEncoder(nn.Module):
    """Embeddings + layers + final norm. Returns (hidden (B, T, C), pooled (B, C) or None).

    `pool` = the sequence classifier's pooling (the CLS row, or the mean over real tokens); the
    base model has no pooler.
    """

    def __init__(self, c: ModernBertConfig, pool: bool = False):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c.vocab_size, c.hidden_size, 0, 0, c.pad_token_id, c.norm_eps,
                                     c.embedding_dropout, norm_bias=c.norm_bias)
        self.layers = nn.ModuleList([ModernBertLayer(c, i) for i in range(c.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(c.head_dim, c.rope(t), c.max_position_embeddings)
                                     for t in sorted(set(c.attention_types))})
        self.pooling = c.classifier_pooling if pool else None

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:
        """HF's init: truncated normals, output projections scaled down by depth."""
        c = self.config
        cut, std = c.initializer_cutoff_factor, c.initializer_range
        _trunc_normal(self.embeddings.word_embeddings, std, cut, is_fresh)
        for layer in members(self.layers, ModernBertLayer):
            for linear, s in ((layer.attn.qkv_proj, std), (layer.mlp.up_proj, std), (layer.attn.o_proj, _out_std(c)),
                              (layer.mlp.down_proj, _out_std(c))):
                _trunc_normal(linear, s, cut, is_fresh)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # token_type_ids: accepted (tokenizers return them) and unused, as in transformers: no type embeddings
        x = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)  # (B, T, C)
        B, T = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(T, device=x.device).unsqueeze(0)
        masks = {"full_attention": bidirectional_mask(attention_mask, T),
                 "sliding_attention": sliding_window_mask(attention_mask, B, T, self.config.window, x.device)}
        ropes = {t: rotary(x, position_ids) for t, rotary in self.rotary.items()}  # cos, sin: (B|1, T, D)
        for layer in members(self.layers, ModernBertLayer):
            x = layer(x, masks[layer.attention_type], ropes[layer.attention_type])
        x = self.final_norm(x)
        return x, self.pool(x, attention_mask)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "mean":
            if attention_mask is None:
                attention_mask = torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.bool)
            # HF's expression: the integer mask's sum divides (no clamp, no cast before)
            return (hidden * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)
        return None


# ---- heads -------------------------------------------------------------------------------------
class PredictionHead(nn.Module):
    """dense -> act -> norm: the transform in front of every ModernBERT classifier and decoder."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.config = c
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, bias=c.classifier_bias)
        self.act = activation(c.classifier_activation)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:
        _trunc_normal(self.dense, _out_std(self.config), self.config.initializer_cutoff_factor, is_fresh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class PooledHead(nn.Module):
    """pooled (B, C) -> transform -> dropout -> classifier."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.config = c
        self.transform = PredictionHead(c)
        self.dropout = nn.Dropout(c.classifier_dropout)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:
        _trunc_classifier(self.classifier, self.config, is_fresh)

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.transform(pooled)))


class MaskedLMHead(nn.Module):
    """transform -> logits against the word embeddings (or an untied decoder) plus the decoder bias."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.config = c
        self.transform = PredictionHead(c)
        self.decoder = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size)) if c.decoder_bias else None

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:  # an untied decoder: transformers' ForMaskedLM init
        if self.decoder is not None:
            _trunc_normal(self.decoder, _out_std(self.config), self.config.initializer_cutoff_factor, is_fresh)

    def reset_parameters_hf(self, std: float) -> None:
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        weight = embedding_weight if self.decoder is None else self.decoder.weight
        return F.linear(self.transform(hidden), weight, self.bias)  # (..., V)


class ModernBertForMaskedLM(ForMaskedLM):
    """The shared masked LM, plus `sparse_prediction`: with labels, logits only at labelled positions."""

    config: ModernBertConfig
    model: ModernBertEncoder

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None) -> ModelOutput:
        if not (self.config.sparse_prediction and labels is not None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels)
        hidden, _ = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds)
        labels = labels.view(-1)
        keep = labels != self.config.sparse_pred_ignore_index
        picked = hidden.view(labels.shape[0], -1)[keep]  # (N, C): the labelled positions only
        logits = self.head(picked, self.model.embeddings.word_embeddings.weight)  # (N, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels[keep].view(-1))
        return ModelOutput(logits=logits, loss=loss, last_hidden_state=hidden)


class ModernBertForTokenClassification(ForTokenClassification):
    """The shared token classifier, with ModernBERT's init of its classifier (hidden_size^-0.5)."""

    config: ModernBertConfig

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:
        _trunc_classifier(self.classifier, self.config, is_fresh)


class ModernBertForQuestionAnswering(ForQuestionAnswering):
    """The shared span head, with ModernBERT's init of its classifier (HF's `classifier`: kiln's qa_outputs)."""

    config: ModernBertConfig

    def after_init(self) -> None:
        self.after_fresh(_everything)

    def after_fresh(self, is_fresh: IsFresh) -> None:
        _trunc_classifier(self.qa_outputs, self.config, is_fresh)


# kiln name (under `model.`) <-> HF name (under `model.` in task checkpoints)
BASE_KEYS = KeyMap([
    ("embeddings.word_embeddings", "embeddings.tok_embeddings"),
    ("embeddings.norm", "embeddings.norm"),
    ("layers.{}.attn_norm", "layers.{}.attn_norm"),
    ("layers.{}.attn.qkv_proj", "layers.{}.attn.Wqkv"),
    ("layers.{}.attn.o_proj", "layers.{}.attn.Wo"),
    ("layers.{}.mlp_norm", "layers.{}.mlp_norm"),
    ("layers.{}.mlp.up_proj", "layers.{}.mlp.Wi"),
    ("layers.{}.mlp.down_proj", "layers.{}.mlp.Wo"),
    ("final_norm", "final_norm"),
])

MLM_KEYS = KeyMap([
    ("head.bias", "decoder.bias"),  # before the `decoder` rule: the bias lives beside an untied decoder too
    ("head.decoder", "decoder"),
    ("head.transform", "head"),
])

# ModernBERT: global, local, global; a local window of |i - j| <= 4, shorter than the long test rows; no biases,
# CLS pooling, tied decoder. Pad 0, cls/bos 2, sep/eos 3.
TINY = Tiny(dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                 bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3),
            specials=bert.SPECIALS,
            long_rows=True,
            variants={
                # every bias on, mean pooling, no decoder bias, explicit layer_types (local first) and rope thetas
                # per type, a window (|i - j| <= 8) longer than the short row: the unmasked SDPA path on the local layer
                "biased-mean": {"attention_bias": True, "mlp_bias": True, "norm_bias": True, "classifier_bias": True,
                                "decoder_bias": False, "classifier_pooling": "mean", "local_attention": 16,
                                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 300.0}},
                                "hidden_activation": "gelu_pytorch_tanh", "classifier_activation": "silu"}})

FAMILY = Family(
    model_type="modernbert",
    config_cls=ModernBertConfig,
    hf_prefix="model",
    base_keys=BASE_KEYS,
    tasks={
        BASE: TaskSpec("ModernBertModel", lambda c: BaseModel(ModernBertEncoder(c))),
        SEQUENCE_CLASSIFICATION: TaskSpec(
            "ModernBertForSequenceClassification",
            lambda c: ForSequenceClassification(ModernBertEncoder(c, pool=True), PooledHead(c)),
            KeyMap([("head.transform", "head"), ("head.classifier", "classifier")])),
        TOKEN_CLASSIFICATION: TaskSpec(
            "ModernBertForTokenClassification",
            lambda c: ModernBertForTokenClassification(ModernBertEncoder(c), c.hidden_size, c.num_labels,
                                                       c.classifier_dropout, transform=PredictionHead(c)),
            KeyMap([("transform", "head"), ("classifier", "classifier")])),
        QUESTION_ANSWERING: TaskSpec(
            "ModernBertForQuestionAnswering",
            lambda c: ModernBertForQuestionAnswering(ModernBertEncoder(c), c.hidden_size, c.classifier_dropout,
                                           transform=PredictionHead(c)),
            KeyMap([("transform", "head"), ("qa_outputs", "classifier")])),
        MASKED_LM: TaskSpec(
            "ModernBertForMaskedLM", lambda c: ModernBertForMaskedLM(ModernBertEncoder(c), MaskedLMHead(c)), MLM_KEYS),
    },
    tiny=TINY,
)
