"""XLM-RoBERTa: RoBERTa's network under its own model_type, with a SentencePiece (Unigram) vocabulary.

Kept as its own family so AutoConfig reports `xlm-roberta`, exports write `XLMRoberta*`
architectures, and its tokenizer.json (Unigram, `<mask>`) is read by the tokenizers library.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models import roberta


@dataclass
class XLMRobertaConfig(roberta.RobertaConfig):
    model_type = "xlm-roberta"

    vocab_size: int = 30522  # transformers' default for this model_type


FAMILY = roberta.family("xlm-roberta", XLMRobertaConfig, "roberta", "XLMRoberta")
