"""Per-token log-probabilities of given tokens under a kiln causal LM, without (tokens x vocab) logits.

Preference optimization and RL score sequences by log p(token t+1 | tokens <= t) summed over the
completion. `token_logps` runs the model once (through its DDP / FSDP wrapper, so gradients sync as
for any step), keeps the hidden states only at the positions whose next token is a target, and sends
those through the LM head a chunk of rows at a time (`linear_token_logps`): each chunk's fp32 logits
are reduced to their log-sum-exp and the target's logit, then dropped; the backward recomputes one
chunk at a time. Peak memory beyond the model is one chunk of logits (`CHUNK_ELEMENTS`, the fused
cross entropy's budget in kiln.models.common.loss) plus the (vocab x hidden) head gradient.

On the exact path (`[train] exact = true`, or a model `set_fast` never switched on, or a
tensor-parallel head) the full logits go through `log_softmax`, as TRL computes them; the fast path is
within fp32 rounding of it. `sequence_logps` sums per-token values into per-row totals and counts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.common.loss import CHUNK_ELEMENTS, head_operands

__all__ = ["linear_token_logps", "sequence_logps", "token_logps"]


class _LinearTokenLogps(torch.autograd.Function):
    """log_softmax(h W^T + b)[i, t_i] per row i, chunk by chunk; the backward recomputes each chunk.

    The incoming gradient is per row (unlike a summed loss), so the gradient cannot be formed in the
    forward as kiln's fused cross entropy does: the forward keeps only each row's log-sum-exp, and the
    backward rebuilds a chunk's softmax from it, d logp_i / d logits_i = onehot(t_i) - softmax_i.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, rows):  # h (N, C), weight (V, C), bias (V,) | None, targets (N,)
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        with torch.autocast(h.device.type, enabled=False):  # dtypes were settled by the caller
            for s in range(0, h.shape[0], rows):
                logits = F.linear(h[s:s + rows], weight, bias).float()  # (n, V)
                lse[s:s + rows] = torch.logsumexp(logits, dim=-1)
                out[s:s + rows] = logits.gather(1, targets[s:s + rows, None]).squeeze(1) - lse[s:s + rows]
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,)
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        rows = ctx.rows
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                hc, tc, gc = h[s:s + rows], targets[s:s + rows], grad_out[s:s + rows].float()
                probs = F.linear(hc, weight, bias).float().sub_(lse[s:s + rows, None]).exp_()  # softmax (n, V)
                g = probs.mul_(-gc[:, None])  # -g_i softmax_i ...
                g[torch.arange(tc.shape[0], device=tc.device), tc] += gc  # ... + g_i onehot(t_i)
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(weight.dtype)
                if need_h:
                    grad_h[s:s + rows] = g @ weight  # (n, C)
                if need_w and g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)  # (V, C) in place: no temporary of the weight's size
                elif need_w:
                    grad_w += (g.t() @ hc).float()
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None


def linear_token_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       bias: torch.Tensor | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """fp32 log_softmax(h W^T + b)[i, targets[i]] for h (N, C), weight (V, C), targets (N,) -> (N,),
    `chunk_rows` rows of logits at a time (default: about CHUNK_ELEMENTS logits). Differentiable in h,
    weight and bias; under autocast the matmuls run in the autocast dtype, as `nn.Linear` would."""
    if h.dim() != 2 or targets.shape != h.shape[:1] or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise KilnError(f"linear_token_logps: h {tuple(h.shape)}, weight {tuple(weight.shape)} and targets "
                        f"{tuple(targets.shape)} do not fit (want (N, C), (V, C), (N,))")
    h, weight, bias = head_operands(h, weight, bias)
    if h.shape[0] == 0:  # no targets: an empty result that still reaches the graph
        return (h.sum() * 0.0 + weight.sum() * 0.0).float().expand(0)
    rows = chunk_rows or max(1, min(h.shape[0], CHUNK_ELEMENTS // weight.shape[0]))
    return _LinearTokenLogps.apply(h, weight, bias, targets, rows)


def _core(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP (`.module`); FSDP2 and plain models are their own."""
    core = getattr(model, "module", model)
    if not hasattr(core, "output_weight") or not hasattr(core, "head"):
        raise KilnError(f"token_logps needs a causal LM (kiln ForCausalLM); got {type(core).__name__}")
    return core


def token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                targets_mask: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """(B, T) fp32: at position t, log p(input_ids[:, t+1] | input_ids[:, :t+1]) where
    targets_mask[:, t+1] is true (the mask marks the scored tokens, aligned with input_ids), else 0;
    the last position is always 0. Differentiable; `chunk` rows of logits at a time on the fast path.

    `model` is a kiln causal LM, or DDP / FSDP2 around one: it is called through its wrapper (with
    `logits_to_keep=1`, so the forward itself makes one position's logits) for its hidden states.
    """
    if input_ids.dim() != 2 or targets_mask.shape != input_ids.shape or (
            attention_mask is not None and attention_mask.shape != input_ids.shape):
        raise KilnError(f"token_logps: input_ids {tuple(input_ids.shape)}, targets_mask "
                        f"{tuple(targets_mask.shape)} and attention_mask "
                        f"{None if attention_mask is None else tuple(attention_mask.shape)} must all be (B, T)")
    core = _core(model)
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1)
    hidden = out.last_hidden_state  # (B, T, C)
    targets = F.pad(input_ids[:, 1:], (0, 1))  # (B, T): token t+1 at position t
    keep = F.pad(targets_mask[:, 1:].bool(), (0, 1), value=False)  # (B, T)
    if not core._fused_head():  # the exact path: the full logits, as TRL's selective_log_softmax
        logits = core.head(hidden).float()  # (B, T, V)
        picked = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        return picked.masked_fill(~keep, 0.0)
    if core.fp32_logits:
        hidden = hidden.to(core.output_weight.dtype)
    head_bias = None if core.lm_head is None else core.lm_head.bias
    picked = linear_token_logps(hidden[keep], core.output_weight, targets[keep], head_bias, chunk)  # (N,)
    return torch.zeros(keep.shape, dtype=torch.float32, device=hidden.device).index_put((keep,), picked)


def sequence_logps(logps: torch.Tensor, targets_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row sum of `token_logps`' values (B,), per-row count of scored tokens (B,)) for the same
    `targets_mask`; the first token is never scored (nothing predicts it)."""
    count = targets_mask[:, 1:].sum(-1)
    return logps.sum(-1), count
