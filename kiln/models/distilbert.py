"""DistilBERT: BERT's encoder, distilled, with its own names and four deltas.

- no token types and no pooler; LayerNorm eps fixed at 1e-12;
- no dropout on the attention output (only after the MLP);
- sequence classification: h[:, 0] -> pre_classifier -> ReLU -> dropout -> classifier;
- optional fixed sinusoidal positions (`sinusoidal_pos_embds`), frozen as HF freezes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import ConfigError
from kiln.models import bert
from kiln.models.common.encoder import Embeddings, Encoder, EncoderLayer
from kiln.models.config import FamilyConfig
from kiln.models.heads import (
    BaseModel,
    FirstTokenClassifier,
    ForMaskedLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    MLMHead,
)
from kiln.models.keymap import KeyMap
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.tasks import BASE, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

EPS = 1e-12


@dataclass
class DistilBertConfig(FamilyConfig):
    model_type = "distilbert"

    vocab_size: int = 30522
    max_position_embeddings: int = 512
    sinusoidal_pos_embds: bool = False
    n_layers: int = 6
    n_heads: int = 12
    dim: int = 768
    hidden_dim: int = 3072
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"
    initializer_range: float = 0.02
    qa_dropout: float = 0.1
    seq_classif_dropout: float = 0.2
    pad_token_id: int | None = 0

    def validate(self, source: str = "config.json") -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"{source}: dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")

    @property
    def hidden_size(self) -> int:  # the name shared code and tools look for
        return self.dim


def sinusoidal_positions(n_pos: int, dim: int) -> torch.Tensor:
    """The fixed table, computed in float64 as the original recipe does, then cast to float32."""
    angle = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)])
    table = torch.empty(n_pos, dim)
    table[:, 0::2] = torch.FloatTensor(np.sin(angle[:, 0::2]))
    table[:, 1::2] = torch.FloatTensor(np.cos(angle[:, 1::2]))
    return table


class DistilEmbeddings(Embeddings):
    def __init__(self, c: DistilBertConfig):
        super().__init__(c.vocab_size, c.dim, c.max_position_embeddings, 0, c.pad_token_id, EPS, c.dropout)
        self.sinusoidal = c.sinusoidal_pos_embds

    def after_init(self) -> None:
        if self.sinusoidal:
            with torch.no_grad():
                assert self.position_embeddings is not None  # distilbert keeps a table of positions
                w = self.position_embeddings.weight
                w.copy_(sinusoidal_positions(*w.shape).to(w.dtype))
            w.requires_grad_(False)


def backbone(c: DistilBertConfig) -> Encoder:
    layers = [EncoderLayer(c.dim, c.n_heads, c.hidden_dim, c.activation, EPS, c.dropout, c.attention_dropout,
                           attn_output_dropout=False) for _ in range(c.n_layers)]
    return Encoder(DistilEmbeddings(c), layers)


BASE_KEYS = KeyMap([
    ("embeddings.word_embeddings", "embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("embeddings.norm", "embeddings.LayerNorm"),
    ("layers.{}.attn.q_proj", "transformer.layer.{}.attention.q_lin"),
    ("layers.{}.attn.k_proj", "transformer.layer.{}.attention.k_lin"),
    ("layers.{}.attn.v_proj", "transformer.layer.{}.attention.v_lin"),
    ("layers.{}.attn.o_proj", "transformer.layer.{}.attention.out_lin"),
    ("layers.{}.attn_norm", "transformer.layer.{}.sa_layer_norm"),
    ("layers.{}.mlp.up_proj", "transformer.layer.{}.ffn.lin1"),
    ("layers.{}.mlp.down_proj", "transformer.layer.{}.ffn.lin2"),
    ("layers.{}.mlp_norm", "transformer.layer.{}.output_layer_norm"),
])

TINY = Tiny(dict(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64),
            specials=bert.SPECIALS)

FAMILY = Family(
    model_type="distilbert",
    config_cls=DistilBertConfig,
    hf_prefix="distilbert",
    base_keys=BASE_KEYS,
    extra_keys=(r"embeddings\.position_ids",),
    tasks={
        BASE: TaskSpec("DistilBertModel", lambda c: BaseModel(backbone(c))),
        SEQUENCE_CLASSIFICATION: TaskSpec(
            "DistilBertForSequenceClassification",
            lambda c: ForSequenceClassification(backbone(c), FirstTokenClassifier(
                c.dim, c.num_labels, c.seq_classif_dropout, act="relu", dropout_first=False)),
            KeyMap([("head.dense", "pre_classifier"), ("head.out_proj", "classifier")])),
        TOKEN_CLASSIFICATION: TaskSpec(
            "DistilBertForTokenClassification",
            lambda c: ForTokenClassification(backbone(c), c.dim, c.num_labels, c.dropout),
            KeyMap([("classifier", "classifier")])),
        QUESTION_ANSWERING: TaskSpec(
            "DistilBertForQuestionAnswering",
            lambda c: ForQuestionAnswering(backbone(c), c.dim, dropout=c.qa_dropout),
            KeyMap([("qa_outputs", "qa_outputs")])),
        MASKED_LM: TaskSpec(
            "DistilBertForMaskedLM",
            lambda c: ForMaskedLM(backbone(c), MLMHead(c.dim, c.vocab_size, c.activation, EPS,
                                                       tied=c.tie_word_embeddings)),
            # order matters: the projector's bias is the head bias, its weight the (untied) decoder
            KeyMap([("head.dense", "vocab_transform"), ("head.norm", "vocab_layer_norm"),
                    ("head.bias", "vocab_projector.bias"), ("head.decoder", "vocab_projector")])),
    },
    tiny=TINY,
)
