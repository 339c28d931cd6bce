"""Autoregressive generation for kiln causal LMs: KV cache, greedy or sampled, stop on EOS.

One prefill pass over the (left-padded) prompt fills the cache; each later step feeds one token per row
(a backbone without a decoding cache is fed the whole sequence again instead). Sampling applies
temperature, then top-k, then top-p (nucleus) to float32 logits and draws with a seeded generator, so a
seed reproduces a reply (a caller may bring its own draw instead). Rows that reached EOS are padded while
the others finish. Positions follow the attention mask (pads do not count).

`generate` first offers the call to the registered generators (`register_generator`; kiln.engine registers its
padded-batch backend, kiln.engine.padded, when imported): the first that takes it runs it; the loop runs the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.errors import KilnError

# generators a call is offered to before the loop: fn(model, input_ids, **generate's keywords) -> (B, T + n) ids,
# or None when the call is not theirs (a layer above registers one: kiln.engine.padded)
GENERATORS: list[Callable[..., torch.Tensor | None]] = []


def register_generator(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Offer every `generate` call to `fn` before the loop (in registration order); returns fn."""
    if fn not in GENERATORS:
        GENERATORS.append(fn)
    return fn


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(B, V) float logits with temperature applied and tokens outside top-k / top-p set to -inf."""
    if temperature <= 0:
        raise KilnError(f"temperature must be > 0, got {temperature} (use greedy decoding for deterministic output)")
    if not 0 < top_p <= 1:
        raise KilnError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)  # the low-probability tail whose mass stays under 1 - top_p
        drop[..., -1] = False      # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None = None, block: int = 1024,
                u: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) token ids, row b's drawn with probability probs[b] / probs[b].sum() (probs (B, V) >= 0, some > 0 in
    each row), from one uniform number per row: it picks a block of `block` entries by the float64 running sum
    of the blocks' sums, then an entry by the float64 running sum inside that block. The same distribution as
    torch.multinomial(probs, 1) (to float32 rounding of each block's sum), not the same draws: multinomial
    spends an exponential variate per vocabulary entry (~40 ms for 8 rows of 151,936 on one core), this ~1.5 ms.
    `u` (B,) float64 in [0, 1): each row's uniform, given (the engine draws each from its row's own generator);
    None: drawn here from `generator`. An entry of probability 0 is never drawn."""
    B, V = probs.shape
    block = min(block, V)
    full = V // block * block
    sums = probs[:, :full].reshape(B, -1, block).sum(-1)  # (B, V // block), each block summed alone
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], 1)
    cdf = sums.double().cumsum(-1)  # (B, blocks)
    total = cdf[:, -1:]
    if not bool((total > 0).all()):
        raise KilnError("inverse_cdf: a row has no token of positive probability (left after its filters)")
    if u is None:
        u = torch.rand((B,), generator=generator, dtype=torch.float64, device=probs.device)
    elif u.shape != (B,):
        raise ValueError(f"inverse_cdf: u must be one uniform per row, shape ({B},), got {tuple(u.shape)}")
    target = u[:, None] * total  # (B, 1)
    # the first block whose running sum passes the target (u * total may round up to the total: then the last
    # block of positive mass)
    blk = torch.minimum(torch.searchsorted(cdf, target, right=True), (cdf < total).sum(-1, keepdim=True))
    before = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)  # the mass of the blocks before it
    idx = blk * block + torch.arange(block, device=probs.device)  # (B, block)
    inside = probs.gather(1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0).double().cumsum(-1)
    last = inside[:, -1:]
    rest = (target - before) / (cdf.gather(1, blk) - before) * last  # the target's place on the block's own sum
    token = torch.minimum(torch.searchsorted(inside, rest, right=True), (inside < last).sum(-1, keepdim=True))
    return (blk * block + token).squeeze(1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None,
             prompt_inputs: dict[str, torch.Tensor] | None = None,
             draw: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Prompt ids (B, T) -> (B, T + n) with n <= max_new_tokens; `on_token` sees each new (B,) column.
    `prompt_inputs` (an image-text model's pixel_values, image_grid_thw, ...) go with the prompt's pass.
    `draw` (with do_sample): float32 logits (B, V) -> (B,) token ids, in place of temperature / top-k / top-p
    and the seeded multinomial draw (the caller then owns the randomness; `seed` is not used)."""
    if input_ids.dim() != 2 or input_ids.size(1) == 0:
        raise KilnError(f"input_ids must be (batch, length>0), got shape {tuple(input_ids.shape)}")
    for fn in GENERATORS:
        taken = fn(model, input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                   do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   eos_token_id=eos_token_id, pad_token_id=pad_token_id, on_token=on_token,
                   prompt_inputs=prompt_inputs, draw=draw)
        if taken is not None:
            return taken
    config = model.config
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), device=input_ids.device)
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id if config.pad_token_id is not None
                                                         else (int(eos_ids[0]) if len(eos_ids) else 0))
    device = input_ids.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None and draw is None else None
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, T)
    cache = model.new_cache()  # None: no incremental state, every step re-reads the sequence
    was_training = model.training
    model.eval()
    out, step_ids = input_ids, input_ids
    unfinished = torch.ones(input_ids.size(0), dtype=torch.bool, device=device)
    try:
        for _ in range(max_new_tokens):
            extra = {} if prompt_inputs is None or (cache is not None and step_ids is not input_ids) else (
                prompt_inputs if step_ids is input_ids else  # no cache: the whole sequence with its images again
                {k: v for k, v in prompt_inputs.items() if k != "mm_token_type_ids"})
            logits = model(step_ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1,
                           **extra).logits[:, -1, :].to(dtype=torch.float32)  # (B, V)
            if do_sample and draw is not None:
                token = draw(logits)
            elif do_sample:
                probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                token = logits.argmax(-1)
            token = torch.where(unfinished, token, torch.full_like(token, pad))
            out = torch.cat([out, token[:, None]], dim=-1)
            if on_token is not None:
                on_token(token)
            if len(eos_ids):
                unfinished &= ~torch.isin(token, eos_ids)
                if not bool(unfinished.any()):
                    break
            mask = torch.cat([mask, mask.new_ones(mask.size(0), 1)], dim=-1)
            if cache is not None:
                step_ids, positions = token[:, None], positions[:, -1:] + 1
            else:
                step_ids, positions = out, torch.cat([positions, positions[:, -1:] + 1], dim=-1)
    finally:
        model.train(was_training)
    return out
