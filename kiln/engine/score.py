"""The scoring forward: per-token log-probs of whole sequences through the engine's own kernels.

`token_logps(model, sequences, starts)` runs each sequence once, its keys in a private buffer laid out as the
paged cache's blocks, through the same tiled projections, block attention and per-row log_softmax as a
generation step (kiln.engine.runner). A token's log-prob therefore has the same bits whether the engine
produced it in a decode step, in a chunk of a prefill, beside 31 other requests, or here: RL's gap between the
sampler's and the scorer's log-probs is 0 when the scorer is this. It is differentiable (autograd through
every op), so a trainer can take its gradient; against kiln's training forward (`ForCausalLM.token_logps`:
one batched matrix product per layer, SDPA) it agrees to fp32 rounding, not bit for bit: the training
forward's products see every row of the batch at once, which is what makes them fast.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kiln.engine.exact import log_softmax_rows
from kiln.engine.runner import DecoderRunner, unsupported
from kiln.errors import KilnError

_LOGIT_ROWS = 64  # positions whose logits are made at once (a bound on the (rows x vocab) buffer)


def runner_for(model) -> DecoderRunner:
    """The runner of `model`, made once (its rotary table) and kept on the model."""
    why = unsupported(model)
    if why:
        raise KilnError(why)
    cached = getattr(model, "_engine_runner", None)
    weight = model.model.embed_tokens.weight
    if cached is None or (cached.device, cached.dtype) != (weight.device, weight.dtype):
        positions = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        cached = DecoderRunner(model, positions)
        object.__setattr__(model, "_engine_runner", cached)  # not a submodule: never saved, never moved
    return cached


def token_logps(model, sequences: Sequence[Sequence[int]], starts: Sequence[int], *, block_size: int = 16
                ) -> list[torch.Tensor]:
    """For each sequence ids (S,) and start s >= 1: float32 (S - s,) log p(ids[t] | ids[:t]) for t >= s, the
    raw logits' log_softmax (temperature 1). `block_size` must be the engine's (it fixes the summation order)."""
    if len(sequences) != len(starts):
        raise KilnError(f"token_logps: {len(sequences)} sequences but {len(starts)} starts")
    runner = runner_for(model)
    out = []
    for ids, s in zip(sequences, starts):
        ids = [int(t) for t in ids]
        if not 1 <= s <= len(ids):
            raise KilnError(f"token_logps: start {s} is outside [1, {len(ids)}] for a sequence of {len(ids)} tokens")
        hidden = runner.dense(ids, block_size)[s - 1:len(ids) - 1]  # (S - s, C): the positions before each target
        target = torch.tensor(ids[s:], device=hidden.device)
        parts = []
        for r in range(0, hidden.shape[0], _LOGIT_ROWS):
            lp = log_softmax_rows(runner.logits(hidden[r:r + _LOGIT_ROWS]))
            parts.append(lp.gather(1, target[r:r + _LOGIT_ROWS, None]).squeeze(1))
        out.append(torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32))
    return out

