"""RoBERTa: BERT's encoder with three deltas.

- positions count real tokens from pad_token_id + 1 (pads keep pad_token_id);
- sequence classification reads the <s> token through its own dense+tanh head, not the pooler;
- the MLM head always uses exact GELU (whatever `hidden_act` says) and lives at `lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models import bert
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


@dataclass
class RobertaConfig(bert.BertConfig):
    model_type = "roberta"

    vocab_size: int = 50265
    pad_token_id: int | None = 1  # RoBERTa: <pad> is id 1 and anchors the position count
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2


def backbone(c: RobertaConfig, pooler: bool):
    return bert.backbone(c, pooler, padding_positions=True)  # RoBERTa: positions skip padding


def family(model_type: str, config_cls: type, hf_prefix: str, arch: str) -> Family:
    """The RoBERTa layout under another name (XLM-RoBERTa is the same network, its own model_type)."""
    return Family(
        model_type=model_type,
        config_cls=config_cls,
        hf_prefix=hf_prefix,
        base_keys=bert.BASE_KEYS,
        extra_keys=bert.EXTRA_KEYS,
        tasks={
            BASE: TaskSpec(f"{arch}Model", lambda c: BaseModel(backbone(c, pooler=True))),
            SEQUENCE_CLASSIFICATION: TaskSpec(
                f"{arch}ForSequenceClassification",
                lambda c: ForSequenceClassification(
                    backbone(c, pooler=False), FirstTokenClassifier(c.hidden_size, c.num_labels, c.head_dropout)),
                KeyMap([("head.dense", "classifier.dense"), ("head.out_proj", "classifier.out_proj")])),
            TOKEN_CLASSIFICATION: TaskSpec(
                f"{arch}ForTokenClassification",
                lambda c: ForTokenClassification(backbone(c, pooler=False), c.hidden_size, c.num_labels, c.head_dropout),
                KeyMap([("classifier", "classifier")])),
            QUESTION_ANSWERING: TaskSpec(
                f"{arch}ForQuestionAnswering",
                lambda c: ForQuestionAnswering(backbone(c, pooler=False), c.hidden_size),
                KeyMap([("qa_outputs", "qa_outputs")])),
            MASKED_LM: TaskSpec(
                f"{arch}ForMaskedLM",
                lambda c: ForMaskedLM(backbone(c, pooler=False), MLMHead(
                    c.hidden_size, c.vocab_size, "gelu", c.layer_norm_eps, tied=c.tie_word_embeddings)),
                KeyMap([("head.dense", "lm_head.dense"), ("head.norm", "lm_head.layer_norm"),
                        ("head.bias", "lm_head.bias"), ("head.decoder", "lm_head.decoder")])),
        },
    )


SPECIALS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "mask_token": "<mask>"}

# positions start after the padding id, so max_position_embeddings keeps room for it
TINY = Tiny(dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=72, type_vocab_size=1),
            specials=SPECIALS)

FAMILY = family("roberta", RobertaConfig, "roberta", "Roberta").with_tiny(TINY)
