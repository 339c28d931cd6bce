"""DeBERTa-v2 and v3 (model_type "deberta-v2"): BERT's post-LN layers with disentangled attention.

Choices (each a delta from the BERT scaffold):
- embeddings: word [+ absolute position when `position_biased_input`] [+ token type when
  `type_vocab_size` > 0] in `embedding_size` (lifted by a bias-free projection when it differs),
  LayerNorm, then multiplied by the padding mask;
- attention scores = c2c + c2p + p2c (`pos_att_type`), each scaled by sqrt(head_dim * (1 + #types)); the
  relative terms read one table of 2 * span relative embeddings shared by all layers (LayerNorm'd when
  `norm_rel_ebd` says "layer_norm"), projected by each layer's q/k projections (`share_att_key`) or its
  own pos projections; relative distances fall into log buckets beyond `position_buckets` / 2;
- the attention math is HF's own (bmm, masked_fill with the dtype's min, softmax), not SDPA, so padded
  query rows attend uniformly exactly as HF's do;
- an optional ConvLayer (`conv_kernel_size` > 0) mixes the embeddings into the first layer's output;
- heads: ContextPooler (h[:, 0] -> dense -> act) for sequence classification, with DeBERTa's own loss when
  `problem_type` is unset; the MLM head is the legacy BERT-style `cls.predictions` one, or, with
  `legacy: false`, `lm_predictions.lm_head` (matmul against the word embeddings, then + bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError, KilnError
from kiln.models.common.activations import activation
from kiln.models.common.encoder import EncoderLayer
from kiln.models.config import FamilyConfig
from kiln.models.heads import (
    BaseModel,
    ForMaskedLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    MLMHead,
    ModelOutput,
)
from kiln.models.keymap import KeyMap
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.tasks import BASE, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

# Keys HF reads with getattr(config, key, default): written back only when set, since a null would not
# read back as the default.
_ABSENT_IF_NONE = ("embedding_size", "attention_head_size", "pooler_hidden_size", "cls_dropout")


@dataclass
class DebertaV2Config(FamilyConfig):
    model_type = "deberta-v2"

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-7
    relative_attention: bool = False
    max_relative_positions: int = -1
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    position_biased_input: bool = True
    pos_att_type: list[str] | str | None = None
    pooler_dropout: float = 0.0
    pooler_hidden_act: str = "gelu"
    legacy: bool = True
    # Read by HF's modules with getattr defaults (not declared by its config class):
    position_buckets: int = -1
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    conv_kernel_size: int = 0
    conv_groups: int = 1
    conv_act: str = "tanh"
    embedding_size: int | None = None
    attention_head_size: int | None = None
    pooler_hidden_size: int | None = None
    cls_dropout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pos_att_type, str):  # "p2c|c2p" as older configs write it
            self.pos_att_type = [x.strip() for x in self.pos_att_type.lower().split("|")]

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_head_size not in (None, head_dim):
            raise ConfigError(f"{source}: attention_head_size {self.attention_head_size} is not supported; "
                              f"it must equal hidden_size / num_attention_heads ({head_dim})")
        if self.pooler_hidden_size not in (None, self.hidden_size):
            raise ConfigError(f"{source}: pooler_hidden_size ({self.pooler_hidden_size}) must equal hidden_size "
                              f"({self.hidden_size})")
        if self.conv_kernel_size > 0 and self.conv_kernel_size % 2 == 0:
            raise ConfigError(f"{source}: conv_kernel_size must be odd (it pads (k - 1) / 2 on each side), "
                              f"got {self.conv_kernel_size}")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in _ABSENT_IF_NONE:
            if out.get(key, 0) is None and key not in self.extra:
                del out[key]
        return out

    # ---- derived sizes, as HF derives them ----------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.embedding_size if self.embedding_size is not None else self.hidden_size

    @property
    def att_types(self) -> tuple[str, ...]:
        return tuple(self.pos_att_type or ())

    @property
    def max_relative(self) -> int:
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Half the number of relative embeddings: one per bucket, or per distance up to max_relative."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative

    @property
    def head_dropout(self) -> float:
        return self.hidden_dropout_prob if self.cls_dropout is None else self.cls_dropout


# ---- relative positions ------------------------------------------------------------------------
def log_bucket_positions(rel: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """Distances under buckets / 2 stay exact; farther ones share log-spaced buckets reaching max_position.

    Float32 arithmetic in HF's order, so every distance lands in the same bucket as in transformers.
    """
    mid = buckets // 2
    sign = torch.sign(rel)
    near = (rel < mid) & (rel > -mid)
    dist = torch.where(near, torch.tensor(mid - 1).type_as(rel), torch.abs(rel))  # near ones: a placeholder
    log_pos = torch.ceil(torch.log(dist / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(dist <= mid, rel.type_as(log_pos), log_pos * sign)


@dataclass
class RelativeInputs:
    """What every layer's attention reads besides x: the shared table and where each pair looks in it."""
    embeddings: torch.Tensor  # (2S, C) relative embeddings, after the optional LayerNorm
    c2p_index: torch.Tensor   # (1, T, T) query i, key j -> row of the table for distance i - j
    p2c_index: torch.Tensor   # (1, T, T) the same for the reversed distance j - i


def relative_inputs(c: DebertaV2Config, embeddings: torch.Tensor, seq_len: int) -> RelativeInputs:
    """Distances i - j, bucketed, as indices into the 2 * span table (computed once per forward)."""
    ids = torch.arange(seq_len, dtype=torch.long, device=embeddings.device)
    rel = ids[:, None] - ids[None, :]  # (T, T)
    if c.position_buckets > 0 and c.max_relative > 0:
        rel = log_bucket_positions(rel, c.position_buckets, c.max_relative)
    rel = rel.to(torch.long).unsqueeze(0)  # (1, T, T)
    span = c.att_span
    return RelativeInputs(embeddings,
                          c2p_index=torch.clamp(rel + span, 0, span * 2 - 1),
                          p2c_index=torch.clamp(-rel + span, 0, span * 2 - 1))


class DisentangledSelfAttention(nn.Module):
    """Content-to-content plus content-to-position and position-to-content scores, HF's order of operations."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        dim = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        # The score scale counts pos_att_type even when relative attention is off, as HF does.
        factor = 1 + ("c2p" in c.att_types) + ("p2c" in c.att_types)
        # a 0-dim float32 CPU tensor like HF's, so the division rounds identically (not a Python float)
        self.scale = torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float, device="cpu") * factor)
        self.relative = c.relative_attention
        self.c2p = self.relative and "c2p" in c.att_types
        self.p2c = self.relative and "p2c" in c.att_types
        self.span = c.att_span
        self.share_att_key = c.share_att_key
        if self.relative and not self.share_att_key:
            self.pos_key_proj = nn.Linear(dim, dim) if self.c2p else None
            self.pos_query_proj = nn.Linear(dim, dim) if self.p2c else None
        self.pos_dropout = nn.Dropout(c.hidden_dropout_prob)
        self.dropout = nn.Dropout(c.attention_probs_dropout_prob)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, C) -> (N * H, T, D): HF's batched-heads layout for bmm."""
        N, T, _ = x.shape
        return x.view(N, T, self.num_heads, -1).permute(0, 2, 1, 3).contiguous().view(-1, T, self.head_dim)

    def forward(self, x: torch.Tensor, masked: torch.Tensor, rel: RelativeInputs | None = None) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C); masked: (B, 1, T, T) bool, True = may not attend
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))  # (B*H, T, D)
        scale = self.scale.to(dtype=q.dtype)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale)  # (B*H, T, T); HF scales k, not the scores
        if self.relative and (self.c2p or self.p2c):
            if rel is None:
                raise KilnError("DeBERTa's relative attention needs the relative inputs (the encoder passes them)")
            scores = scores.add_(self.relative_scores(q, k, rel, scale))  # in place: bmm's backward reads its inputs only
        scores = scores.view(B, self.num_heads, T, T).masked_fill_(masked, torch.finfo(q.dtype).min)
        probs = self.dropout(F.softmax(scores, dim=-1))
        y = torch.bmm(probs.view(-1, T, T), v)  # (B*H, T, D)
        y = y.view(B, self.num_heads, T, self.head_dim).permute(0, 2, 1, 3).contiguous().view(B, T, C)
        return self.o_proj(y)

    def relative_scores(self, q: torch.Tensor, k: torch.Tensor, rel: RelativeInputs,
                        scale: torch.Tensor) -> torch.Tensor:
        """c2p + p2c scores (B*H, T, T), each divided by the scale.

        HF's GEMM shapes exactly (the whole table projected, repeated per batch row): BLAS kernels pick
        their blocking by shape, so a smaller or batch-shared product can round differently.
        """
        BH, T, _ = q.shape
        batch = BH // self.num_heads
        table = self.pos_dropout(rel.embeddings)[: self.span * 2].unsqueeze(0)  # (1, 2S, C)
        score = None
        if self.c2p:  # query content i against the embedding of distance i - j
            proj = self.k_proj if self.share_att_key else self.pos_key_proj
            if proj is None:
                raise KilnError("c2p attention without its pos_key_proj (share_att_key is off)")
            pos_k = self.heads(proj(table)).repeat(batch, 1, 1)  # (B*H, 2S, D)
            c2p = torch.bmm(q, pos_k.transpose(-1, -2))  # (B*H, T, 2S)
            c2p = torch.gather(c2p, dim=-1, index=rel.c2p_index.expand(BH, T, T))  # (B*H, T, T)
            score = c2p.div_(scale)  # in place: gather's output is fresh and its backward does not read it
        if self.p2c:  # key content j against the embedding of distance j - i, transposed to (i, j)
            proj = self.q_proj if self.share_att_key else self.pos_query_proj
            if proj is None:
                raise KilnError("p2c attention without its pos_query_proj (share_att_key is off)")
            pos_q = self.heads(proj(table)).repeat(batch, 1, 1)  # (B*H, 2S, D)
            p2c = torch.bmm(k, pos_q.transpose(-1, -2))  # (B*H, T, 2S)
            p2c = torch.gather(p2c, dim=-1, index=rel.p2c_index.expand(BH, T, T)).transpose(-1, -2)
            score = p2c.div_(scale) if score is None else score.add_(p2c.div_(scale))
        if score is None:
            raise KilnError("relative_scores runs for c2p or p2c attention; this layer has neither")
        return score


class ConvLayer(nn.Module):
    """DeBERTa-v2's n-gram mixer: conv over the embeddings, added to the first layer's output, LayerNorm."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        k = c.conv_kernel_size
        self.conv = nn.Conv1d(c.hidden_size, c.hidden_size, k, padding=(k - 1) // 2, groups=c.conv_groups)
        self.act = activation(c.conv_act)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, input_mask: torch.Tensor) -> torch.Tensor:
        out = self.conv(x.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()  # (B, T, C)
        out = out.masked_fill((1 - input_mask).bool().unsqueeze(-1), 0)  # no conv output at pads
        out = self.act(self.dropout(out))
        y = residual + out
        y = self.norm(y).to(y)
        return y * input_mask.unsqueeze(2).to(y.dtype)


class DebertaEmbeddings(nn.Module):
    def __init__(self, c: DebertaV2Config):
        super().__init__()
        dim = c.embedding_dim
        self.word_embeddings = nn.Embedding(c.vocab_size, dim, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, dim) if c.position_biased_input else None
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, dim) if c.type_vocab_size > 0 else None
        self.embed_proj = nn.Linear(dim, c.hidden_size, bias=False) if dim != c.hidden_size else None
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                position_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                mask: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, E)
        # DeBERTa: positions are added before token types (BERT adds them after)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = x + self.position_embeddings(position_ids.long())
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
            x = x + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)  # (B, T, C)
        x = self.norm(x)
        x = x * mask.unsqueeze(2).to(x.dtype)  # DeBERTa: pads embed to zero
        return self.dropout(x)


class DebertaEncoder(nn.Module):
    """Embeddings + layers sharing one relative-embedding table (+ the conv after layer 0). No pooler."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.config = c
        self.embeddings = DebertaEmbeddings(c)
        self.layers = nn.ModuleList([
            EncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.hidden_act, c.layer_norm_eps,
                         c.hidden_dropout_prob, c.attention_probs_dropout_prob, attn=DisentangledSelfAttention(c))
            for _ in range(c.num_hidden_layers)])
        self.rel_embeddings = nn.Embedding(c.att_span * 2, c.hidden_size) if c.relative_attention else None
        norm_rel = [x.strip() for x in c.norm_rel_ebd.lower().split("|")]
        self.rel_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if "layer_norm" in norm_rel else None
        self.conv = ConvLayer(c) if c.conv_kernel_size > 0 else None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is None:
            raise KilnError("give input_ids or inputs_embeds")
        shape = ref.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(shape, device=ref.device)  # float ones, as HF makes them
        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds, attention_mask)  # (B, T, C)
        pair = attention_mask[:, None, None, :]  # (B, 1, 1, T)
        masked = ~(pair * pair.squeeze(-2).unsqueeze(-1)).bool()  # (B, 1, T, T): pad rows and columns
        rel = None
        if self.rel_embeddings is not None:
            table = self.rel_embeddings.weight  # (2S, C)
            if self.rel_norm is not None:
                table = self.rel_norm(table)
            rel = relative_inputs(self.config, table, shape[1])
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h, masked, rel=rel)
            if i == 0 and self.conv is not None:
                h = self.conv(x, h, attention_mask)
        return h, None


# ---- heads -------------------------------------------------------------------------------------
class ContextPooler(nn.Module):
    """h[:, 0] -> dropout -> dense -> act (`pooler_hidden_act`)."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.dropout = nn.Dropout(c.pooler_dropout)
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.act = activation(c.pooler_hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(self.dropout(hidden[:, 0])))  # (B, C)


class ContextPoolerClassifier(nn.Module):
    """ContextPooler -> dropout (`cls_dropout`, else hidden dropout) -> classifier."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.pooler = ContextPooler(c)
        self.dropout = nn.Dropout(c.head_dropout)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))  # (B, num_labels)


class DebertaForSequenceClassification(ForSequenceClassification):
    """With `problem_type` unset, DeBERTa's own loss: regression for one label, labels < 0 ignored, and
    soft labels (B, num_labels) scored by cross-entropy against log-softmax."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None) -> ModelOutput:
        if labels is None or self.config.problem_type:
            return super().forward(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, labels)
        out = super().forward(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        logits, n = out.logits, self.config.num_labels  # (B, n)
        if logits is None:
            raise KilnError("the sequence classifier returned no logits")
        if n == 1:
            logits = logits.view(-1).to(labels.dtype)  # HF returns these flattened logits
            out.loss = F.mse_loss(logits, labels.view(-1))
        elif labels.dim() == 1 or labels.size(-1) == 1:
            keep = (labels >= 0).nonzero()  # (K, 1) rows with a label
            labels = labels.long()
            if keep.size(0) > 0:
                picked = torch.gather(logits, 0, keep.expand(keep.size(0), logits.size(1)))
                out.loss = F.cross_entropy(picked.view(-1, n).float(), torch.gather(labels, 0, keep.view(-1)).view(-1))
            else:
                out.loss = torch.tensor(0).to(logits)
        else:
            out.loss = -((F.log_softmax(logits, -1) * labels).sum(-1)).mean()
        out.logits = logits
        return out


class DebertaLMHead(nn.Module):
    """legacy=false: HF's `lm_predictions.lm_head`, logits = matmul(x, E^T) + bias (not one fused linear)."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        if c.embedding_dim != c.hidden_size:
            raise ConfigError("legacy: false MLM head needs embedding_size equal to hidden_size "
                              f"({c.embedding_dim} != {c.hidden_size})")
        self.lm_head = MLMHead(c.hidden_size, c.vocab_size, c.hidden_act, c.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        h = self.lm_head
        x = h.norm(h.act(h.dense(hidden)))
        return torch.matmul(x, embedding_weight.t()) + h.bias  # (B, T, V)


def mlm_head(c: DebertaV2Config) -> nn.Module:
    if not c.legacy:
        return DebertaLMHead(c)
    # the legacy head is BERT's, sized to embedding_size; an untied decoder keeps its own bias
    return MLMHead(c.hidden_size, c.vocab_size, c.hidden_act, c.layer_norm_eps, out_dim=c.embedding_dim,
                   tied=c.tie_word_embeddings, decoder_bias=True)


_LAYER = "encoder.layer.{}"

# kiln name (under `model.`) <-> HF name (under `deberta.` in task checkpoints)
BASE_KEYS = KeyMap([
    ("embeddings.word_embeddings", "embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("embeddings.token_type_embeddings", "embeddings.token_type_embeddings"),
    ("embeddings.embed_proj", "embeddings.embed_proj"),
    ("embeddings.norm", "embeddings.LayerNorm"),
    ("layers.{}.attn.q_proj", f"{_LAYER}.attention.self.query_proj"),
    ("layers.{}.attn.k_proj", f"{_LAYER}.attention.self.key_proj"),
    ("layers.{}.attn.v_proj", f"{_LAYER}.attention.self.value_proj"),
    ("layers.{}.attn.pos_key_proj", f"{_LAYER}.attention.self.pos_key_proj"),
    ("layers.{}.attn.pos_query_proj", f"{_LAYER}.attention.self.pos_query_proj"),
    ("layers.{}.attn.o_proj", f"{_LAYER}.attention.output.dense"),
    ("layers.{}.attn_norm", f"{_LAYER}.attention.output.LayerNorm"),
    ("layers.{}.mlp.up_proj", f"{_LAYER}.intermediate.dense"),
    ("layers.{}.mlp.down_proj", f"{_LAYER}.output.dense"),
    ("layers.{}.mlp_norm", f"{_LAYER}.output.LayerNorm"),
    ("rel_embeddings", "encoder.rel_embeddings"),
    ("rel_norm", "encoder.LayerNorm"),
    ("conv.conv", "encoder.conv.conv"),
    ("conv.norm", "encoder.conv.LayerNorm"),
])

MLM_KEYS = KeyMap([
    ("head.dense", "cls.predictions.transform.dense"),
    ("head.norm", "cls.predictions.transform.LayerNorm"),
    ("head.bias", "cls.predictions.bias"),
    ("head.decoder", "cls.predictions.decoder"),
    ("head.lm_head.dense", "lm_predictions.lm_head.dense"),  # legacy: false
    ("head.lm_head.norm", "lm_predictions.lm_head.LayerNorm"),
    ("head.lm_head.bias", "lm_predictions.lm_head.bias"),
])

# DeBERTa-v3 style: log buckets (8) under 64 relative positions, shared keys, both relative terms, LayerNorm'd
# relative table, no absolute positions; token types on so they are exercised. Pad 0 as DebertaV2Config's default.
TINY = Tiny(dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=64, type_vocab_size=2, relative_attention=True, position_buckets=8,
                 max_relative_positions=64, share_att_key=True, pos_att_type=["p2c", "c2p"],
                 norm_rel_ebd="layer_norm", position_biased_input=False),
            specials={"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
                      "mask_token": "[MASK]"},
            long_rows=True,  # distances past the relative-position buckets
            variants={
                # v2 style: no buckets, 16 relative positions (clamped on the long rows), own pos projections, the
                # conv after layer 0, absolute positions, and embedding_size lifted by embed_proj
                "v2-conv": {"position_buckets": -1, "max_relative_positions": 16, "share_att_key": False,
                            "pos_att_type": "c2p|p2c", "norm_rel_ebd": "none", "position_biased_input": True,
                            "conv_kernel_size": 3, "conv_act": "gelu", "embedding_size": 24},
                # no relative attention, no token types: what remains is BERT with DeBERTa's mask handling
                "absolute": {"relative_attention": False, "type_vocab_size": 0, "position_biased_input": True}})

FAMILY = Family(
    model_type="deberta-v2",
    config_cls=DebertaV2Config,
    hf_prefix="deberta",
    base_keys=BASE_KEYS,
    extra_keys=(r"embeddings\.position_ids",),  # a buffer older checkpoints carry
    tasks={
        BASE: TaskSpec("DebertaV2Model", lambda c: BaseModel(DebertaEncoder(c))),
        SEQUENCE_CLASSIFICATION: TaskSpec(
            "DebertaV2ForSequenceClassification",
            lambda c: DebertaForSequenceClassification(DebertaEncoder(c), ContextPoolerClassifier(c)),
            KeyMap([("head.pooler.dense", "pooler.dense"), ("head.classifier", "classifier")])),
        TOKEN_CLASSIFICATION: TaskSpec(
            "DebertaV2ForTokenClassification",
            lambda c: ForTokenClassification(DebertaEncoder(c), c.hidden_size, c.num_labels, c.hidden_dropout_prob),
            KeyMap([("classifier", "classifier")])),
        QUESTION_ANSWERING: TaskSpec(
            "DebertaV2ForQuestionAnswering",
            lambda c: ForQuestionAnswering(DebertaEncoder(c), c.hidden_size),
            KeyMap([("qa_outputs", "qa_outputs")])),
        MASKED_LM: TaskSpec(
            "DebertaV2ForMaskedLM", lambda c: ForMaskedLM(DebertaEncoder(c), mlm_head(c)), MLM_KEYS),
    },
    tiny=TINY,
)
