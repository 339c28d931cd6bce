"""One-call tasks over a model directory or a loaded kiln model: fill_mask, classify, embed, generate.

Each takes either a path (loaded with the right Auto class) or a model already in memory, and
returns plain Python values, like transformers' pipelines.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.engine.continuer import Continuer
from kiln.errors import KilnError
from kiln.hub import Tokenizer
from kiln.hub.resolve import resolve_model_dir
from kiln.models import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification
from kiln.models.auto import _AutoTask
from kiln.models.heads import BaseModel, ForMaskedLM, ForSequenceClassification
from kiln.models.pretrained import PreTrainedModel
from kiln.models.qwen3_5_vision import ImageTextForCausalLM as VisionTextForCausalLM
from kiln.models.sentence import Pooling, SentenceModelMixin, load_sentence_model

Source = str | os.PathLike | torch.nn.Module


def _model(src: Source, auto: type[_AutoTask]) -> PreTrainedModel:
    model = src if isinstance(src, torch.nn.Module) else auto.from_pretrained(src)
    if not isinstance(model, PreTrainedModel):
        raise KilnError(f"a {type(model).__name__} is not a kiln model (load one with kiln.models' Auto classes)")
    _tokenizer(model)
    return model.eval()


def _tokenizer(model: PreTrainedModel) -> Tokenizer:
    if model.tokenizer is None:
        raise KilnError("this model has no tokenizer (no tokenizer.json or vocab.txt in its directory)")
    return model.tokenizer


def _not_a(model: PreTrainedModel, what: str) -> KilnError:
    return KilnError(f"model_type {model.config.model_type!r} loaded as {type(model).__name__}, not {what}")


def fill_mask(src: Source, text: str, k: int = 5) -> list[dict]:
    """Top-k fillers for each mask token: [{position, token, token_id, score, sequence}]."""
    model = _model(src, AutoModelForMaskedLM)
    if not isinstance(model, ForMaskedLM):
        raise _not_a(model, "a masked-LM head")
    return model.fill_mask(text, k=k)


def classify(src: Source, texts: list[str] | str, max_length: int = 512) -> list[list[dict]]:
    """Per text, every label with its score, best first (softmax; sigmoid for multi-label; raw for regression)."""
    model = _model(src, AutoModelForSequenceClassification)
    if not isinstance(model, ForSequenceClassification):
        raise _not_a(model, "a sequence-classification head")
    texts = [texts] if isinstance(texts, str) else texts
    batch = _tokenizer(model).encode(texts, max_length=max_length)
    with torch.no_grad():
        logits = model(**batch).logits.float()
    kind = model.config.problem_type or ("regression" if model.config.num_labels == 1 else "single_label_classification")
    scores = {"regression": logits, "multi_label_classification": logits.sigmoid()}.get(kind, logits.softmax(-1))
    labels = model.config.labels
    return [sorted(({"label": labels[j], "score": float(row[j])} for j in range(len(labels))),
                   key=lambda d: -d["score"]) for row in scores]


def embed(src: Source, texts: list[str], normalize: bool | None = None) -> torch.Tensor:
    """Sentence embeddings, (N, hidden): pooled and normalised as a sentence-transformers directory's files
    say (modules.json, 1_Pooling), else mean-pooled and L2-normalised; `normalize` overrides either."""
    if not isinstance(src, torch.nn.Module) and Pooling.read(resolve_model_dir(src)) is not None:
        sentence = load_sentence_model(resolve_model_dir(src))
        _model(sentence, AutoModel)
        return sentence.embed(texts, normalize=normalize)
    model = _model(src, AutoModel)
    if isinstance(model, SentenceModelMixin):
        return model.embed(texts, normalize=True if normalize is None else normalize)
    if not isinstance(model, BaseModel):
        raise _not_a(model, "a base model (the hidden states embeddings pool)")
    return model.embed(texts, normalize=True if normalize is None else normalize)


def generate(src: Source, prompt: str, max_new_tokens: int = 40, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, images: list | None = None, image_processor: Any = None,
             eos_token_id: int | list[int] | None = None) -> str:
    """The continuation of `prompt` (greedy when temperature is 0), stopping at EOS (or `eos_token_id`).
    `images` (paths or PIL images) go before the prompt, for an image-text model (processed as its directory's
    preprocessor_config.json says, or `image_processor`)."""
    model = _model(src, AutoModelForCausalLM)
    tok = _tokenizer(model)
    ids = tok.backend.encode(prompt, add_special_tokens=False).ids
    inputs = None
    if images:
        if not isinstance(model, VisionTextForCausalLM):
            raise KilnError(f"model_type {model.config.model_type!r} takes no images (it has no vision tower)")
        model_dir = None if isinstance(src, torch.nn.Module) else src
        image_ids, inputs = model.image_prompt(images, image_processor, model_dir)
        ids = image_ids + ids
    if not ids:
        raise KilnError("the prompt is empty after tokenization")
    run = Continuer(model, max_new_tokens, temperature, top_k, top_p, seed, eos_token_ids=eos_token_id, max_seqs=1)
    return tok.decode(run(list(ids), inputs))
