"""The scoring forward: per-token log-probs of whole sequences through the engine's own kernels.

`token_logps(model, sequences, starts)` runs the sequences packed into one pass (`DecoderRunner.dense_many`:
each sequence's keys in a private buffer laid out as the paged cache's blocks), through the same tiled
projections, block attention and per-row log_softmax as a generation step (kiln.engine.runner). A token's
log-prob therefore has the same bits whether the engine produced it in a decode step, in a chunk of a prefill,
beside 31 other requests, or here, alone or packed with other sequences: RL's gap between the sampler's and the
scorer's log-probs is 0 when the scorer is this. `temperature` divides the float32 logits before the
log_softmax, the op a rollout applies to the engine's logits (kiln.train.grpo_engine), so log-probs at a
sampling temperature match too. It is differentiable, so a trainer can take its gradient: autograd through
the body; the LM head with its log_softmax is one function (`_HeadLogps`) whose backward takes each chunk of rows'
softmax again with one whole-chunk product (a gradient carries no bit promise: the head's row tiles are for
the forward's bits) and makes the hidden and weight gradients of the chunk with two more, rather than keeping
rows x vocabulary logits or differentiating the forward's tiles (a weight gradient per tile);
against kiln's training forward (`ForCausalLM.token_logps`: one batched matrix product per layer, SDPA) it
agrees to fp32 rounding, not bit for bit: the training forward's products see every row of the batch at
once, which is what makes them fast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from kiln.engine.cache import BLOCK_SIZE
from kiln.engine.exact import log_softmax_rows
from kiln.engine.runner import DecoderRunner, unsupported
from kiln.errors import KilnError

_LOGIT_ROWS = 64  # positions whose logits are made at once (a bound on the (rows x vocab) buffer)


class _RunnerSlot:  # engfeat: the runner kept on a model, left behind by copies (deepcopy, pickle)
    """Holds a model's runner. A copy of the model gets an empty slot (the copy makes its own runner on first
    use): the runner holds the original model, and a runner class cannot be rebuilt without its arguments."""

    __slots__ = ("runner",)

    def __init__(self) -> None:
        self.runner: DecoderRunner | None = None

    def __deepcopy__(self, memo: dict) -> _RunnerSlot:
        return _RunnerSlot()

    def __reduce__(self) -> tuple:
        return (_RunnerSlot, ())


def runner_for(model) -> DecoderRunner:
    """The runner of `model`, made once (its rotary table) and kept on the model (in a `_RunnerSlot`)."""
    why = unsupported(model)
    if why:
        raise KilnError(why)
    slot = model.__dict__.get("_engine_runner")
    if not isinstance(slot, _RunnerSlot) or (slot.runner is not None and slot.runner.model is not model):
        slot = _RunnerSlot()  # (a shallow copy.copy shares its original's slot: it gets its own)
        object.__setattr__(model, "_engine_runner", slot)  # not a submodule: never saved, never moved
    cached = slot.runner
    weight = model.model.embed_tokens.weight
    if cached is None or (cached.device, cached.dtype) != (weight.device, weight.dtype):
        positions = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
        cached = slot.runner = DecoderRunner(model, positions)
    return cached


def release_packed(model) -> None:
    """Drop the packed LM head copy of `model`'s scoring runner, if it has one (a trainer calls this after an
    optimizer step: the copy is stale then, and would sit beside the update's activations until the next use)."""
    slot = model.__dict__.get("_engine_runner")
    if isinstance(slot, _RunnerSlot) and slot.runner is not None:
        slot.runner.forget_weights()


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature (elementwise division is correctly rounded: the same bits in any layout)."""
    return logits if temperature == 1.0 else logits / temperature


def token_logps(model, sequences: Sequence[Sequence[int]], starts: Sequence[int], *, block_size: int = BLOCK_SIZE,
                temperature: float = 1.0) -> list[torch.Tensor]:
    """For each sequence ids (S,) and start s >= 1: float32 (S - s,) log p(ids[t] | ids[:t]) for t >= s, the
    log_softmax of logits / temperature (no filters). `block_size` must be the engine's (it fixes the
    summation order; the default is the Engine's, kiln.engine.cache.BLOCK_SIZE). All sequences run in one packed pass."""
    if len(sequences) != len(starts):
        raise KilnError(f"token_logps: {len(sequences)} sequences but {len(starts)} starts")
    if not temperature > 0:
        raise KilnError(f"token_logps: temperature must be > 0, got {temperature}")
    runner = runner_for(model)
    seqs = [[int(t) for t in ids] for ids in sequences]
    rows, targets, sizes, at = [], [], [], 0
    for ids, s in zip(seqs, starts):
        if not 1 <= s <= len(ids):
            raise KilnError(f"token_logps: start {s} is outside [1, {len(ids)}] for a sequence of {len(ids)} tokens")
        rows += range(at + s - 1, at + len(ids) - 1)  # the positions before each target
        targets += ids[s:]
        sizes.append(len(ids) - s)
        at += len(ids)
    if not seqs:
        return []
    hidden = runner.dense_many(seqs, block_size)[torch.tensor(rows, dtype=torch.long, device=runner.device)]
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)

    def chunk(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        lp = log_softmax_rows(tempered(runner.logits(h, _LOGIT_ROWS), temperature))
        return lp.gather(1, t[:, None]).squeeze(1)

    weight = runner.head_weight()
    if weight is not None:
        picked = _HeadLogps.apply(runner.head_input(hidden, weight), weight, target, runner, temperature)
        return list(picked.split(sizes))
    # a head that is no plain product (kiln.engine.runner.head_weight): autograd through its tiles, each chunk's
    # logits recomputed in the backward
    keep = torch.is_grad_enabled() and hidden.requires_grad
    parts = [checkpoint(chunk, hidden[r:r + _LOGIT_ROWS], target[r:r + _LOGIT_ROWS], use_reentrant=False) if keep
             else chunk(hidden[r:r + _LOGIT_ROWS], target[r:r + _LOGIT_ROWS])
             for r in range(0, hidden.shape[0], _LOGIT_ROWS)]
    picked = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    return list(picked.split(sizes))


class _HeadLogps(torch.autograd.Function):
    """log_softmax(h @ weight^T / temperature)[target] (N,) float32 for normed rows h (N, C): the forward through
    the runner's exact head (the engine's bits), chunk by chunk; the backward with whole-chunk products."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, runner: DecoderRunner,
                temperature: float) -> torch.Tensor:
        parts = []
        for r in range(0, h.shape[0], _LOGIT_ROWS):
            lp = log_softmax_rows(tempered(runner.product_logits(h[r:r + _LOGIT_ROWS], weight, _LOGIT_ROWS),
                                           temperature))
            parts.append(lp.gather(1, target[r:r + _LOGIT_ROWS, None]).squeeze(1))
        ctx.save_for_backward(h, weight, target)
        ctx.temperature, ctx.runner = temperature, runner
        return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, target = ctx.saved_tensors
        temp = ctx.temperature
        product, _ = ctx.runner.head_product(weight)  # the forward's packed weight, reused (no bit promise here)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for r in range(0, h.shape[0], _LOGIT_ROWS):
            hc, t, u = h[r:r + _LOGIT_ROWS], target[r:r + _LOGIT_ROWS], grad[r:r + _LOGIT_ROWS] / temp
            # d log p[t] / d logits = (onehot(t) - softmax(logits / temp)) / temp, times the incoming gradient
            g = torch.softmax(tempered(product(hc).float(), temp), -1).mul_(-u[:, None])
            g[torch.arange(t.shape[0], device=t.device), t] += u
            g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[r:r + _LOGIT_ROWS] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), hc)
        return grad_h, grad_w, None, None, None
