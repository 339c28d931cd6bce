"""Generation for kiln causal LMs: `generate` (a model's `generate`) and the sampling math under it.

`generate` hands the call to the registered generators (`register_generator`): kiln.engine registers its
padded-batch backend (kiln.engine.padded) when imported, a layer above this one. kiln's earlier static-batch
loop is gone (issue 39: the engine does what it did; benchmarks/old_loop.py keeps a copy as a measured
baseline). `filter_logits` (temperature, top-k, top-p) and `inverse_cdf` (a draw from one uniform a row) are
the floor's sampling helpers; the engine's sampler draws with `inverse_cdf`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.errors import KilnError

# the generators a call is offered to, in order: fn(model, input_ids, **generate's keywords) -> (B, T + n) ids, or
# None when the call is not theirs (a layer above registers one: kiln.engine.padded)
GENERATORS: list[Callable[..., torch.Tensor | None]] = []


def register_generator(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Offer every `generate` call to `fn` (in registration order); returns fn."""
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


def generate(model, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Prompt ids (B, T) -> (B, T + n) with n <= max_new_tokens: a kiln causal LM's `generate`, run by the first
    registered generator that takes the call (kiln.engine.padded: the generation engine, registered when
    kiln.engine is imported). Keywords: attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
    seed, eos_token_id, pad_token_id (and prompt_inputs for an image-text model)."""
    if input_ids.dim() != 2 or input_ids.size(1) == 0:
        raise KilnError(f"input_ids must be (batch, length>0), got shape {tuple(input_ids.shape)}")
    for fn in GENERATORS:
        taken = fn(model, input_ids, **kwargs)
        if taken is not None:
            return taken
    raise KilnError("generate: kiln's generation runs on its engine (kiln.engine), which is not loaded here: "
                    "`import kiln.engine` first (kiln.pipelines, the CLI and the trainer do); kiln's earlier "
                    "loop was removed (issue 39)")
