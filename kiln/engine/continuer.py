"""Continuing token lists with a causal LM on the generation engine.

`Continuer` is what `kiln generate`, `kiln chat`, `kiln eval`'s generation tasks and `kiln.pipelines.generate`
call: one engine kept for its life (so a chat's earlier turns are found in the cache by prefix, and the images it
shows again are not run through the vision tower again). A model the engine cannot run is refused by name when the
Continuer is made (`kiln.engine.runner.unsupported` says why).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.engine.engine import Engine
from kiln.engine.params import SamplingParams
from kiln.engine.runner import unsupported
from kiln.errors import KilnError


class Continuer:
    """Continues token lists with a causal LM through kiln.engine (continuous batching; one engine kept, so a
    chat's earlier turns are found in its cache by prefix and not recomputed, and its images' features are made
    once).

    `many(prompts, prompt_inputs)` runs every prompt at once (the engine batches them as they come and go);
    `__call__` runs one. `prompt_inputs`: an image-text model's images per prompt (pixel_values and
    image_grid_thw as kiln's processor gives them), or None. Each returns the new token ids, the end token included
    when one ended the text."""

    def __init__(self, model: torch.nn.Module, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, eos_token_ids: int | list[int] | None = None,
                 stop: tuple[str, ...] = (), max_seqs: int = 64):
        self.model, self.max_new_tokens, self.stop = model, max_new_tokens, tuple(stop)
        self.sampling: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.eos = [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        why_not = unsupported(model)  # None: the engine runs it
        if why_not is not None:
            raise KilnError(f"cannot generate with this model: {why_not}")
        self.engine = Engine(model, getattr(model, "tokenizer", None) if stop else None,
                             max_seqs=max_seqs, eos_token_ids=self.eos)

    def many(self, prompts: list[list[int]], prompt_inputs: list[dict | None] | None = None) -> list[list[int]]:
        if self.max_new_tokens < 1:
            return [[] for _ in prompts]
        inputs = prompt_inputs if prompt_inputs is not None else [None] * len(prompts)
        params = SamplingParams(max_tokens=self.max_new_tokens, stop=self.stop, **self.sampling)
        return [done[0].token_ids for done in self.engine.generate(prompts, params, inputs)]

    def __call__(self, prompt: list[int], prompt_inputs: dict | None = None) -> list[int]:
        return self.many([prompt], [prompt_inputs])[0]
