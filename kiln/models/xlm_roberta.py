"""XLM-RoBERTa: RoBERTa's network under its own model_type, with a SentencePiece (Unigram) vocabulary.

Kept as its own family so AutoConfig reports `xlm-roberta`, exports write `XLMRoberta*`
architectures, and its tokenizer.json (Unigram, `<mask>`) is read by the tokenizers library.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models import roberta
from kiln.models.pretrained import Tiny


@dataclass
class XLMRobertaConfig(roberta.RobertaConfig):
    model_type = "xlm-roberta"

    vocab_size: int = 30522  # transformers' default for this model_type


# XLM-R checkpoints ship a SentencePiece (Unigram) tokenizer.json
TINY = Tiny(dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=72, type_vocab_size=1),
            specials=roberta.SPECIALS, unigram=True)

FAMILY = roberta.family("xlm-roberta", XLMRobertaConfig, "roberta", "XLMRoberta").with_tiny(TINY)
