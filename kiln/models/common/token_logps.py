"""Per-token log-probabilities of given next tokens, through the LM head a chunk of rows at a time.

Preference optimization and RL score sequences by log p(token t+1 | tokens <= t). `linear_token_logps`
takes the hidden states of the scored positions and the head weight: each chunk's fp32 logits (divided by
the sampling temperature, as TRL divides them) are reduced to their log-sum-exp and the target's logit,
then dropped (the last kept for the backward); the backward recomputes the others one at a time. Peak memory
beyond the model is one chunk of logits (`CHUNK_ELEMENTS`, the fused cross entropy's budget) plus the
(vocab x hidden) head gradient.
`ForCausalLM.token_logps` runs it inside the model's own call, so FSDP2 gathers the head for it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.common.loss import CHUNK_ELEMENTS, head_operands

__all__ = ["exact_token_logps", "linear_token_logps"]


def _chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of `rows` rows over n, the short remainder first: the last chunk is full."""
    first = n % rows or rows
    return [(0, first)] + [(s, s + rows) for s in range(first, n, rows)]


class _LinearTokenLogps(torch.autograd.Function):
    """log_softmax((h W^T + b) / tau)[i, t_i] per row i, chunk by chunk; the backward recomputes each chunk
    but the last, whose logits the forward keeps (it held them anyway, and the backward's first chunk takes
    their place: the peak is unchanged).

    The incoming gradient is per row (unlike a summed loss), so the gradient cannot be formed in the
    forward as kiln's fused cross entropy does: the forward keeps only each row's log-sum-exp, and the
    backward rebuilds a chunk's softmax from it, d logp_i / d logits_i = (onehot(t_i) - softmax_i) / tau.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, rows, temperature, keep):  # h (N, C), weight (V, C), targets (N,)
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        chunks = _chunks(h.shape[0], rows)
        ctx.kept = None
        with torch.autocast(h.device.type, enabled=False):  # dtypes were settled by the caller
            for s, e in chunks:
                logits = F.linear(h[s:e], weight, bias).float()  # (n, V)
                if temperature != 1.0:
                    logits.div_(temperature)
                lse[s:e] = torch.logsumexp(logits, dim=-1)
                out[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
        if keep:  # a backward will come (grad mode was on at the call)
            ctx.kept = logits  # the last chunk's (n, V) logits / tau
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunks, ctx.temperature = chunks, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,)
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tau = ctx.temperature
        kept, ctx.kept = ctx.kept, None  # used up in place here: a second backward (retain_graph) recomputes
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None  # the first chunk's product makes it (zeros first would be one more pass over (V, C))
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
        with torch.autocast(h.device.type, enabled=False):
            for s, e in ctx.chunks[-1:] + ctx.chunks[:-1]:  # the kept chunk first, then it is freed
                hc, tc, gc = h[s:e], targets[s:e], grad_out[s:e].float()
                if tau != 1.0:
                    gc = gc / tau  # the chain rule through logits / tau
                if kept is not None:
                    probs, kept = kept, None
                else:
                    probs = F.linear(hc, weight, bias).float()
                    if tau != 1.0:
                        probs.div_(tau)
                probs = probs.sub_(lse[s:e, None]).exp_()  # softmax (n, V)
                g = probs.mul_(-gc[:, None])  # -g_i softmax_i ...
                g[torch.arange(tc.shape[0], device=tc.device), tc] += gc  # ... + g_i onehot(t_i)
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(weight.dtype)
                if need_h:
                    grad_h[s:e] = g @ weight  # (n, C)
                if need_w and grad_w is None:
                    grad_w = (g.t() @ hc).float()  # (V, C)
                elif need_w and g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)  # in place: no temporary of the weight's size
                elif need_w:
                    grad_w += (g.t() @ hc).float()
                del probs, g
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_token_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       bias: torch.Tensor | None = None, chunk_rows: int | None = None,
                       temperature: float = 1.0) -> torch.Tensor:
    """fp32 log_softmax((h W^T + b) / temperature)[i, targets[i]] for h (N, C), weight (V, C), targets (N,)
    -> (N,), `chunk_rows` rows of logits at a time (default: about CHUNK_ELEMENTS logits). Differentiable in
    h, weight and bias; under autocast the matmuls run in the autocast dtype, as `nn.Linear` would."""
    if h.dim() != 2 or targets.shape != h.shape[:1] or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise KilnError(f"linear_token_logps: h {tuple(h.shape)}, weight {tuple(weight.shape)} and targets "
                        f"{tuple(targets.shape)} do not fit (want (N, C), (V, C), (N,))")
    if not temperature > 0:
        raise KilnError(f"linear_token_logps: temperature must be > 0, got {temperature}")
    h, weight, bias = head_operands(h, weight, bias)
    if h.shape[0] == 0:  # no targets: an empty result that still reaches the graph
        return (h.sum() * 0.0 + weight.sum() * 0.0).float().expand(0)
    rows = chunk_rows or max(1, min(h.shape[0], CHUNK_ELEMENTS // weight.shape[0]))
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    return _LinearTokenLogps.apply(h, weight, bias, targets, rows, float(temperature), keep)


def exact_token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """TRL's computation on full logits (B, T, V): fp32 logits / temperature, log_softmax, the target's
    value (B, T); targets (B, T) must be valid ids everywhere (the caller masks what it does not score)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
