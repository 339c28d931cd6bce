"""`model.generate`'s padded-batch call on the engine: a kiln causal LM's `generate` (kiln.models.common.generation)
runs here when the engine runs its family.

The call's contract is the batch one: prompt ids (B, T), left-padded where an attention mask says so, in; the
prompts with their new tokens (B, T + n) out, n the longest completion, each row padded after its end token.
Each row becomes one request (its padding stripped); the engine batches them continuously. Greedy calls give
the engine's argmax, which is the loop's: the same logits to fp32 rounding (tests/engine compare them per
family). This backend takes greedy calls only: a sampled call's seed drew the whole batch from one generator
in kiln's loop (and from torch.multinomial, the draws transformers' `generate` makes for the same seed), where
the engine draws each request from its own; a call with a caller's own `draw`, a per-step `on_token` (every row
in lockstep) or image inputs is the loop's too. `register_generator` makes it the first choice of
kiln.models.common.generation.generate when kiln.engine is imported.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.engine.engine import Engine
from kiln.engine.params import SamplingParams
from kiln.engine.runner import unsupported
from kiln.models.common.generation import register_generator


def _prompts(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]] | None:
    """Each row's tokens without its left padding, or None when a mask is not left padding (holes, right pads)."""
    if mask is None:
        return input_ids.tolist()
    m = mask.to(torch.long).cpu()
    lengths = m.sum(1)
    width = m.size(1)
    tail = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # left padding: every 1 at the end
    if not bool((m.bool() == tail).all()) or not bool((lengths > 0).all()):
        return None
    return [row[width - int(n):] for row, n in zip(input_ids.tolist(), lengths)]


@register_generator
def engine_generate(model: Any, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                    max_new_tokens: int = 20, do_sample: bool = False, eos_token_id: int | list[int] | None = None,
                    pad_token_id: int | None = None, on_token: Any = None, prompt_inputs: Any = None,
                    draw: Any = None, **_: Any) -> torch.Tensor | None:
    """(B, T + n) on the engine, or None where this call is not the engine's (module docstring)."""
    if do_sample or draw is not None or on_token is not None or prompt_inputs or max_new_tokens < 1:
        return None
    if input_ids.dim() != 2 or input_ids.size(1) == 0 or unsupported(model) is not None:
        return None
    prompts = _prompts(input_ids, attention_mask)
    if prompts is None:
        return None
    config = model.config
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id if config.pad_token_id is not None
                                                         else (eos_ids[0] if eos_ids else 0))
    bs = 16
    blocks = sum(math.ceil((len(p) + max_new_tokens) / bs) + 1 for p in prompts)
    engine = Engine(model, None, block_size=bs, kv_blocks=blocks, max_seqs=len(prompts),
                    step_tokens=max(512, 4 * len(prompts)), eos_token_ids=eos_ids)
    was_training = model.training
    model.eval()  # as the loop: any dropout a module applies in training is off
    try:
        done = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    finally:
        model.train(was_training)
    news = [group[0].token_ids for group in done]
    width = max(len(t) for t in news)
    out = torch.full((len(news), width), int(pad), dtype=input_ids.dtype)
    for i, t in enumerate(news):
        out[i, :len(t)] = torch.tensor(t, dtype=input_ids.dtype)
    return torch.cat([input_ids, out.to(input_ids.device)], 1)
