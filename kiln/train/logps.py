"""Per-token log-probabilities of given tokens under a kiln causal LM, without (tokens x vocab) logits.

Preference optimization and RL score sequences by log p(token t+1 | tokens <= t) summed over the
completion. `token_logps` runs the model once through its wrapper and sends the hidden states of the
positions whose next token is a target through the LM head a chunk of rows at a time
(kiln.models.common.token_logps): peak memory beyond the model is one chunk of logits plus the
(vocab x hidden) head gradient. How the head is reached depends on the wrapper: under DDP its forward
(which readies the gradient sync), then the head; a plain model or an FSDP2 one runs the model's own
`token_logps` method, which FSDP2 hooks like a forward (so the sharded head is gathered for it).

Log-probs are those of logits / `temperature` (TRL's, for sampling at a temperature). On the exact path
(`[train] exact = true`, or a model `set_fast` never switched on, or a tensor-parallel head) the full
logits go through `log_softmax`, as TRL computes them; the fast path is within fp32 rounding of it.
`sequence_logps` sums per-token values into per-row totals and counts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.errors import KilnError
from kiln.models.common.tied_grad import deferred_head
from kiln.models.common.token_logps import linear_token_logps
from kiln.models.common.wrapped import unwrap

__all__ = ["linear_token_logps", "sequence_logps", "token_logps"]


def _core(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP (`.module`); FSDP2 and plain models are their own."""
    core = unwrap(model)
    if not hasattr(core, "hidden_token_logps"):
        raise KilnError(f"token_logps needs a causal LM (kiln ForCausalLM); got {type(core).__name__}")
    return core


def token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                targets_mask: torch.Tensor, *, chunk: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) fp32: at position t, log p(input_ids[:, t+1] | input_ids[:, :t+1]) under logits / temperature
    where targets_mask[:, t+1] is true (the mask marks the scored tokens, aligned with input_ids), else 0;
    the last position is always 0. Differentiable; `chunk` rows of logits at a time on the fast path.

    `model` is a kiln causal LM, or DDP / FSDP2 around one.
    """
    if input_ids.dim() != 2 or targets_mask.shape != input_ids.shape or (
            attention_mask is not None and attention_mask.shape != input_ids.shape):
        raise KilnError(f"token_logps: input_ids {tuple(input_ids.shape)}, targets_mask "
                        f"{tuple(targets_mask.shape)} and attention_mask "
                        f"{None if attention_mask is None else tuple(attention_mask.shape)} must all be (B, T)")
    if not temperature > 0:
        raise KilnError(f"token_logps: temperature must be > 0, got {temperature}")
    core = _core(model)
    keep = F.pad(targets_mask[:, 1:].bool(), (0, 1), value=False)  # (B, T)
    targets = F.pad(input_ids[:, 1:], (0, 1)).masked_fill(~keep, IGNORE_INDEX)  # (B, T): token t+1 at position t
    if model is core:  # plain, or FSDP2 (kiln.parallel.fsdp registered the method as a forward)
        return core.token_logps(input_ids, attention_mask, targets, chunk=chunk, temperature=temperature)
    # DDP: through its forward (with logits_to_keep=1, so the forward itself makes one position's logits)
    head = deferred_head(core)  # before the backbone runs
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1)
    return core.hidden_token_logps(out.last_hidden_state, targets, chunk=chunk, temperature=temperature, head=head)


def sequence_logps(logps: torch.Tensor, targets_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row sum of `token_logps`' values (B,), per-row count of scored tokens (B,)) for the same
    `targets_mask`; the first token is never scored (nothing predicts it)."""
    count = targets_mask[:, 1:].sum(-1)
    return logps.sum(-1), count
