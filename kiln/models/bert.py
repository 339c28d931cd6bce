"""BERT: the post-LN encoder scaffold as it is, with token types, absolute positions and a pooler.

Choices: learned absolute positions 0..T-1; token-type embeddings added before positions;
GELU from `hidden_act`; pooler = tanh(dense(h[:, 0])); MLM decoder tied to the word embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError
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
class BertConfig(FamilyConfig):
    model_type = "bert"

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | None = None

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        pos_type = self.extra.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ConfigError(f"{source}: position_embedding_type {pos_type!r} is not supported (only 'absolute')")
        if self.extra.get("is_decoder"):
            raise ConfigError(f"{source}: is_decoder=true (BERT as a decoder) is not supported")

    @property
    def head_dropout(self) -> float:
        return self.classifier_dropout if self.classifier_dropout is not None else self.hidden_dropout_prob


def encoder_layers(c) -> list[EncoderLayer]:
    return [EncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.hidden_act, c.layer_norm_eps,
                         c.hidden_dropout_prob, c.attention_probs_dropout_prob) for _ in range(c.num_hidden_layers)]


def backbone(c: BertConfig, pooler: bool, padding_positions: bool = False) -> Encoder:
    emb = Embeddings(c.vocab_size, c.hidden_size, c.max_position_embeddings, c.type_vocab_size, c.pad_token_id,
                     c.layer_norm_eps, c.hidden_dropout_prob, padding_positions=padding_positions)
    return Encoder(emb, encoder_layers(c), Pooler(c.hidden_size) if pooler else None)


# kiln name (under `model.`) <-> HF name (under `bert.` in task checkpoints)
BASE_KEYS = KeyMap([
    ("embeddings.word_embeddings", "embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("embeddings.token_type_embeddings", "embeddings.token_type_embeddings"),
    ("embeddings.norm", "embeddings.LayerNorm"),
    ("layers.{}.attn.q_proj", "encoder.layer.{}.attention.self.query"),
    ("layers.{}.attn.k_proj", "encoder.layer.{}.attention.self.key"),
    ("layers.{}.attn.v_proj", "encoder.layer.{}.attention.self.value"),
    ("layers.{}.attn.o_proj", "encoder.layer.{}.attention.output.dense"),
    ("layers.{}.attn_norm", "encoder.layer.{}.attention.output.LayerNorm"),
    ("layers.{}.mlp.up_proj", "encoder.layer.{}.intermediate.dense"),
    ("layers.{}.mlp.down_proj", "encoder.layer.{}.output.dense"),
    ("layers.{}.mlp_norm", "encoder.layer.{}.output.LayerNorm"),
    ("pooler.dense", "pooler.dense"),
])

# Older checkpoints carry these buffers; kiln keeps them so an untouched export equals its source.
EXTRA_KEYS = (r"embeddings\.position_ids", r"embeddings\.token_type_ids")


def mlm_head(c: BertConfig) -> MLMHead:
    return MLMHead(c.hidden_size, c.vocab_size, c.hidden_act, c.layer_norm_eps, tied=c.tie_word_embeddings)


MLM_KEYS = KeyMap([
    ("head.dense", "cls.predictions.transform.dense"),
    ("head.norm", "cls.predictions.transform.LayerNorm"),
    ("head.bias", "cls.predictions.bias"),
    ("head.decoder", "cls.predictions.decoder"),
])

# Tiny test tokenizers of the BERT-style families: pad id 0 as BertConfig's default
SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": "[MASK]"}

# The smallest config that still takes every path (2 layers, several heads, two token types).
TINY = Tiny(dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=64, type_vocab_size=2),
            specials=SPECIALS)

FAMILY = Family(
    model_type="bert",
    config_cls=BertConfig,
    hf_prefix="bert",
    base_keys=BASE_KEYS,
    extra_keys=EXTRA_KEYS,
    tasks={
        BASE: TaskSpec("BertModel", lambda c: BaseModel(backbone(c, pooler=True))),
        SEQUENCE_CLASSIFICATION: TaskSpec(
            "BertForSequenceClassification",
            lambda c: ForSequenceClassification(backbone(c, pooler=True),
                                                PooledClassifier(c.hidden_size, c.num_labels, c.head_dropout)),
            KeyMap([("head.classifier", "classifier")])),
        TOKEN_CLASSIFICATION: TaskSpec(
            "BertForTokenClassification",
            lambda c: ForTokenClassification(backbone(c, pooler=False), c.hidden_size, c.num_labels, c.head_dropout),
            KeyMap([("classifier", "classifier")])),
        QUESTION_ANSWERING: TaskSpec(
            "BertForQuestionAnswering",
            lambda c: ForQuestionAnswering(backbone(c, pooler=False), c.hidden_size),
            KeyMap([("qa_outputs", "qa_outputs")])),
        MASKED_LM: TaskSpec(
            "BertForMaskedLM", lambda c: ForMaskedLM(backbone(c, pooler=False), mlm_head(c)), MLM_KEYS),
    },
    tiny=TINY,
)
