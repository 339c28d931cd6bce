"""`model.generate`'s padded-batch call on the engine: a kiln causal LM's `generate` (kiln.models.common.generation)
runs here (kiln's earlier loop is gone).

The call's contract is the batch one: prompt ids (B, T), left-padded where an attention mask says so, in; the
prompts with their new tokens (B, T + n) out, n the longest completion, each row padded after its end token.
Each row becomes one request (its padding stripped); the engine batches them continuously. Greedy calls give
the engine's argmax, the earlier loop's tokens (the same logits to fp32 rounding). A sampled call with a seed
seeds one generator that draws each row's request seed, so a seed gives the same batch every time; the draws
are the engine's (each request from its own generator), not the earlier loop's one generator for the batch nor
torch.multinomial's (transformers' `generate`). What the engine does not do is refused by name: a family it
does not run (kiln.engine.runner.unsupported), a caller's own `draw` (sample on kiln.engine's
Engine with SamplingParams), a per-step `on_token` (stream with Engine.step), a mask that is not left padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.engine.engine import Engine
from kiln.engine.params import SamplingParams
from kiln.engine.runner import unsupported
from kiln.errors import KilnError
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


def _images_per_row(model: Any, prompts: list[list[int]], inputs: dict | None) -> list[dict | None] | None:
    """The batch's images (pixel_values and image_grid_thw of every image, rows in order, as the processor gives
    them) cut into each row's: a row takes the next images until their placeholders (t * h * w / merge^2 each)
    make its count of image tokens."""
    if not inputs:
        return None
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    merge = model.visual.spatial_merge_size
    out: list[dict | None] = []
    k = at = 0
    for prompt in prompts:
        want, take, rows = sum(t == model.image_token_id for t in prompt), [], 0
        while want > 0 and k < len(grid):
            t, h, w = (int(v) for v in grid[k])
            want -= t * h * w // merge ** 2
            take.append(k)
            rows += t * h * w
            k += 1
        if want != 0:
            raise KilnError(f"generate: row {len(out)}'s image tokens do not match the images given "
                            f"(image_grid_thw {grid.tolist()})")
        # (mm_token_type_ids, the batch's (B, T) marks, is left out: the engine reads each row's from its prompt)
        out.append({"pixel_values": pixels[at:at + rows], "image_grid_thw": grid[take[0]:take[-1] + 1]}
                   if take else None)
        at += rows
    if k != len(grid):
        raise KilnError(f"generate: {len(grid) - k} image(s) beyond the rows' image tokens")
    return out


@register_generator
def engine_generate(model: Any, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                    max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None,
                    pad_token_id: int | None = None, on_token: Any = None, prompt_inputs: Any = None,
                    draw: Any = None) -> torch.Tensor:
    """(B, T + n) on the engine (module docstring); what it does not do raises KilnError naming it."""
    why = unsupported(model)
    if why is not None:
        raise KilnError(f"generate: {why}")
    if draw is not None:
        raise KilnError("generate: `draw` (a caller's own sampler) was kiln's earlier loop's; sample on "
                        "kiln.engine.Engine with SamplingParams (temperature, top_k, top_p, min_p, penalties, seed)")
    if on_token is not None:
        raise KilnError("generate: `on_token` (each step's column of tokens) was kiln's earlier loop's; stream "
                        "with kiln.engine.Engine.step, whose outputs carry each request's new tokens")
    prompts = _prompts(input_ids, attention_mask)
    if prompts is None:
        raise KilnError(f"generate: attention_mask must be left padding (each row's 1s at its end, at least one), "
                        f"got {attention_mask.tolist() if attention_mask is not None else None}")
    if max_new_tokens < 1:
        return input_ids
    config = model.config
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id if config.pad_token_id is not None
                                                         else (eos_ids[0] if eos_ids else 0))
    bs = 16
    blocks = sum(math.ceil((len(p) + max_new_tokens) / bs) + 1 for p in prompts)
    engine = Engine(model, None, block_size=bs, kv_blocks=blocks, max_seqs=len(prompts),
                    step_tokens=max(512, 4 * len(prompts)), eos_token_ids=eos_ids)
    if do_sample:  # one generator for the call, a seed a row from it (each request then draws from its own)
        gen = torch.Generator()
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        seeds = torch.randint(0, 2**62, (len(prompts),), generator=gen).tolist()
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=s) for s in seeds]
    else:
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=0.0)] * len(prompts)
    was_training = model.training
    model.eval()  # any dropout a module applies in training is off, as a generation wants
    try:
        done = engine.generate(prompts, params, _images_per_row(model, prompts, prompt_inputs))
    finally:
        model.train(was_training)
    news = [group[0].token_ids for group in done]
    width = max(len(t) for t in news)
    out = torch.full((len(news), width), int(pad), dtype=input_ids.dtype)
    for i, t in enumerate(news):
        out[i, :len(t)] = torch.tensor(t, dtype=input_ids.dtype)
    return torch.cat([input_ids, out.to(input_ids.device)], 1)
