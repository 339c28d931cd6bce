"""ALBERT: BERT's post-LN encoder with its parameters factorised and shared.

Choices (each a delta from the BERT scaffold):
- embeddings live in a small `embedding_size` space (word + token type + absolute position, LayerNorm),
  lifted to `hidden_size` by one projection;
- `num_hidden_groups` groups of `inner_group_num` layers hold all the block weights; layer i of
  `num_hidden_layers` runs group int(i / (layers / groups)), so with one group every layer is the same block;
- no dropout after the feed-forward (HF applies none there), tanh GELU (`gelu_new`) by default;
- pooler = tanh(dense(h[:, 0])); the MLM head projects back to `embedding_size` before the decoder
  tied to the word embeddings, whose bias is the head's `bias` (tied as HF ties it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.attention import bidirectional_mask
from kiln.models.common.encoder import Embeddings, Encoder, EncoderLayer, Pooler
from kiln.models.config import FamilyConfig
from kiln.models.heads import (
    BaseModel,
    ForMaskedLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    MLMHead,
    PooledClassifier,
)
from kiln.models.keymap import KeyMap
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.tasks import BASE, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION


@dataclass
class AlbertConfig(FamilyConfig):
    model_type = "albert"

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    num_hidden_layers: int = 12
    num_hidden_groups: int = 1
    num_attention_heads: int = 64
    intermediate_size: int = 16384
    inner_group_num: int = 1
    hidden_act: str = "gelu_new"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    classifier_dropout_prob: float | None = 0.1
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 3

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if not 1 <= self.num_hidden_groups <= self.num_hidden_layers:
            raise ConfigError(f"{source}: num_hidden_groups ({self.num_hidden_groups}) must be between 1 and "
                              f"num_hidden_layers ({self.num_hidden_layers})")
        if self.inner_group_num < 1:
            raise ConfigError(f"{source}: inner_group_num must be at least 1, got {self.inner_group_num}")

    @property
    def head_dropout(self) -> float:
        p = self.classifier_dropout_prob
        return self.hidden_dropout_prob if p is None else p


class AlbertEncoder(Encoder):
    """Embeddings -> projection to hidden size -> the shared groups on their schedule (-> pooler)."""

    def __init__(self, c: AlbertConfig, pooler: bool):
        groups = [nn.ModuleList([
            # ALBERT: no dropout after the feed-forward
            EncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.hidden_act, c.layer_norm_eps,
                         c.hidden_dropout_prob, c.attention_probs_dropout_prob, mlp_output_dropout=False)
            for _ in range(c.inner_group_num)]) for _ in range(c.num_hidden_groups)]
        emb = Embeddings(c.vocab_size, c.embedding_size, c.max_position_embeddings, c.type_vocab_size,
                         c.pad_token_id, c.layer_norm_eps, c.hidden_dropout_prob)
        super().__init__(emb, groups, Pooler(c.hidden_size) if pooler else None)
        self.embed_proj = nn.Linear(c.embedding_size, c.hidden_size)  # ALBERT: factorised embeddings
        self.num_hidden_layers = c.num_hidden_layers

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds)  # (B, T, E)
        x = self.embed_proj(x)  # (B, T, C)
        mask = bidirectional_mask(attention_mask, x.shape[1])
        per_group = self.num_hidden_layers / len(self.layers)  # a float, as HF computes the group index
        for i in range(self.num_hidden_layers):
            for layer in cast(nn.ModuleList, self.layers[int(i / per_group)]):  # ALBERT: the group's weights, reused
                x = layer(x, mask)
        return x, (self.pooler(x) if self.pooler is not None else None)


def mlm_head(c: AlbertConfig) -> MLMHead:
    # ALBERT: dense back to embedding_size; an untied decoder keeps its own bias
    return MLMHead(c.hidden_size, c.vocab_size, c.hidden_act, c.layer_norm_eps, out_dim=c.embedding_size,
                   tied=c.tie_word_embeddings, decoder_bias=True)


_LAYER = "encoder.albert_layer_groups.{}.albert_layers.{}"

# kiln name (under `model.`) <-> HF name (under `albert.` in task checkpoints)
BASE_KEYS = KeyMap([
    ("embeddings.word_embeddings", "embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("embeddings.token_type_embeddings", "embeddings.token_type_embeddings"),
    ("embeddings.norm", "embeddings.LayerNorm"),
    ("embed_proj", "encoder.embedding_hidden_mapping_in"),
    ("layers.{}.{}.attn.q_proj", f"{_LAYER}.attention.query"),
    ("layers.{}.{}.attn.k_proj", f"{_LAYER}.attention.key"),
    ("layers.{}.{}.attn.v_proj", f"{_LAYER}.attention.value"),
    ("layers.{}.{}.attn.o_proj", f"{_LAYER}.attention.dense"),
    ("layers.{}.{}.attn_norm", f"{_LAYER}.attention.LayerNorm"),
    ("layers.{}.{}.mlp.up_proj", f"{_LAYER}.ffn"),
    ("layers.{}.{}.mlp.down_proj", f"{_LAYER}.ffn_output"),
    ("layers.{}.{}.mlp_norm", f"{_LAYER}.full_layer_layer_norm"),
    ("pooler.dense", "pooler"),  # ALBERT: the pooler is a bare Linear in HF
])

MLM_KEYS = KeyMap([
    ("head.dense", "predictions.dense"),
    ("head.norm", "predictions.LayerNorm"),
    ("head.bias", "predictions.bias"),
    ("head.decoder", "predictions.decoder"),
])

# ALBERT: two groups of two inner layers over three layer steps, so sharing and the schedule both show; parity
# also runs the classic one-block-for-all-layers shape. Pad 0, bos [CLS] 2, eos [SEP] 3 as AlbertConfig's defaults.
TINY = Tiny(dict(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_hidden_groups=2,
                 inner_group_num=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
                 type_vocab_size=2),
            specials={"pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "[CLS]", "sep_token": "[SEP]",
                      "mask_token": "[MASK]"},
            variants={"one-block": {"num_hidden_groups": 1, "inner_group_num": 1, "num_hidden_layers": 4}})

FAMILY = Family(
    model_type="albert",
    config_cls=AlbertConfig,
    hf_prefix="albert",
    base_keys=BASE_KEYS,
    extra_keys=(r"embeddings\.position_ids", r"embeddings\.token_type_ids"),  # buffers older checkpoints carry
    tasks={
        BASE: TaskSpec("AlbertModel", lambda c: BaseModel(AlbertEncoder(c, pooler=True))),
        SEQUENCE_CLASSIFICATION: TaskSpec(
            "AlbertForSequenceClassification",
            lambda c: ForSequenceClassification(AlbertEncoder(c, pooler=True),
                                                PooledClassifier(c.hidden_size, c.num_labels, c.head_dropout)),
            KeyMap([("head.classifier", "classifier")])),
        TOKEN_CLASSIFICATION: TaskSpec(
            "AlbertForTokenClassification",
            lambda c: ForTokenClassification(AlbertEncoder(c, pooler=False), c.hidden_size, c.num_labels,
                                             c.head_dropout),
            KeyMap([("classifier", "classifier")])),
        QUESTION_ANSWERING: TaskSpec(
            "AlbertForQuestionAnswering",
            lambda c: ForQuestionAnswering(AlbertEncoder(c, pooler=False), c.hidden_size),
            KeyMap([("qa_outputs", "qa_outputs")])),
        MASKED_LM: TaskSpec(
            "AlbertForMaskedLM", lambda c: ForMaskedLM(AlbertEncoder(c, pooler=False), mlm_head(c)), MLM_KEYS),
    },
    tiny=TINY,
)
