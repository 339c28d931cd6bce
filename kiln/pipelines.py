"""One-call tasks over a model directory or a loaded kiln model: fill_mask, classify, embed, generate.

Each takes either a path (loaded with the right Auto class) or a model already in memory, and
returns plain Python values, like transformers' pipelines.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.engine import Engine, SamplingParams
from kiln.engine.runner import unsupported
from kiln.errors import KilnError
from kiln.hub.resolve import resolve_model_dir
from kiln.models import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification
from kiln.models.sentence import Pooling, load_sentence_model

Source = str | os.PathLike | torch.nn.Module


def _model(src: Source, auto) -> torch.nn.Module:
    model = src if isinstance(src, torch.nn.Module) else auto.from_pretrained(src)
    if getattr(model, "tokenizer", None) is None:
        raise KilnError("this model has no tokenizer (no tokenizer.json or vocab.txt in its directory)")
    return model.eval()


def fill_mask(src: Source, text: str, k: int = 5) -> list[dict]:
    """Top-k fillers for each mask token: [{position, token, token_id, score, sequence}]."""
    return _model(src, AutoModelForMaskedLM).fill_mask(text, k=k)


def classify(src: Source, texts: list[str] | str, max_length: int = 512) -> list[list[dict]]:
    """Per text, every label with its score, best first (softmax; sigmoid for multi-label; raw for regression)."""
    model = _model(src, AutoModelForSequenceClassification)
    texts = [texts] if isinstance(texts, str) else texts
    batch = model.tokenizer.encode(texts, max_length=max_length)
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
        model = _model(load_sentence_model(resolve_model_dir(src)), AutoModel)
        return model.embed(texts, normalize=normalize)
    return _model(src, AutoModel).embed(texts, normalize=True if normalize is None else normalize)


class Continuer:
    """Continues token lists with a causal LM: through kiln.engine where it runs the family (continuous
    batching; one engine kept, so a chat's earlier turns are found in its cache by prefix and not recomputed),
    else through the model's own generate loop (image prompts, families the engine does not run yet).

    `many(prompts)` runs every prompt at once (the engine batches them as they come and go); `__call__` runs
    one. Each returns the new token ids, the end token included when one ended the text."""

    def __init__(self, model: torch.nn.Module, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, eos_token_ids: int | list[int] | None = None,
                 stop: tuple[str, ...] = (), max_seqs: int = 64):
        self.model, self.max_new_tokens, self.stop = model, max_new_tokens, tuple(stop)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.eos = [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        self.engine: Engine | None = None
        self.why_not = unsupported(model)  # None: the engine runs it
        if self.why_not is None and max_new_tokens >= 1:
            self.engine = Engine(model, getattr(model, "tokenizer", None) if stop else None,
                                 max_seqs=max_seqs, eos_token_ids=self.eos)

    def many(self, prompts: list[list[int]]) -> list[list[int]]:
        if self.max_new_tokens < 1:
            return [[] for _ in prompts]
        if self.engine is not None:
            params = SamplingParams(max_tokens=self.max_new_tokens, stop=self.stop, **self.sampling)
            return [done[0].token_ids for done in self.engine.generate(prompts, params)]
        return [self(p) for p in prompts]

    def __call__(self, prompt: list[int], prompt_inputs: dict | None = None) -> list[int]:
        if self.engine is not None and not prompt_inputs:
            return self.many([prompt])[0]
        t, kw = self.sampling["temperature"], dict(self.sampling)
        kw.update(do_sample=t > 0, temperature=t if t > 0 else 1.0)
        if self.eos is not None:
            kw["eos_token_id"] = self.eos
        if prompt_inputs:
            kw["prompt_inputs"] = prompt_inputs
        ids = torch.tensor([prompt], device=next(self.model.parameters()).device)
        return self.model.generate(ids, max_new_tokens=self.max_new_tokens, **kw)[0, len(prompt):].tolist()


def generate(src: Source, prompt: str, max_new_tokens: int = 40, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, images: list | None = None, image_processor: Any = None,
             eos_token_id: int | list[int] | None = None) -> str:
    """The continuation of `prompt` (greedy when temperature is 0), stopping at EOS (or `eos_token_id`).
    `images` (paths or PIL images) go before the prompt, for an image-text model (processed as its directory's
    preprocessor_config.json says, or `image_processor`)."""
    model = _model(src, AutoModelForCausalLM)
    ids = model.tokenizer.backend.encode(prompt, add_special_tokens=False).ids
    inputs = None
    if images:
        if not hasattr(model, "image_prompt"):
            raise KilnError(f"model_type {model.config.model_type!r} takes no images (it has no vision tower)")
        model_dir = None if isinstance(src, torch.nn.Module) else src
        image_ids, inputs = model.image_prompt(images, image_processor, model_dir)
        ids = image_ids + ids
    if not ids:
        raise KilnError("the prompt is empty after tokenization")
    run = Continuer(model, max_new_tokens, temperature, top_k, top_p, seed, eos_token_ids=eos_token_id, max_seqs=1)
    return model.tokenizer.decode(run(list(ids), inputs))
