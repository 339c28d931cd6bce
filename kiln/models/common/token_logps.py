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
from kiln.models.common.tied_grad import placeholder_grad

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

    With `deferred` (the weight came through kiln.models.common.tied_grad.deferred_head) the backward makes
    the gradient of h (and b) only, and hands the weight's to `deferred`: the kept chunk's softmax gradient
    and what recomputes the others, run after the backbone's backward (the same products in the same order,
    so the same bits); it returns an expanded zero for the weight meanwhile.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, rows, temperature, keep, deferred):  # h (N, C), weight (V, C)
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
        ctx.chunks, ctx.temperature, ctx.deferred = chunks, temperature, deferred
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,)
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        defer = need_w and ctx.deferred is not None
        kept, ctx.kept = ctx.kept, None  # used up in place here: a second backward (retain_graph) recomputes
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None  # the first chunk's product makes it (zeros first would be one more pass over (V, C))
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
        order = ctx.chunks[-1:] + ctx.chunks[:-1]  # the kept chunk first, then it is freed
        first = None  # deferred: the kept chunk's softmax gradient, for the weight's product later
        with torch.autocast(h.device.type, enabled=False):
            for s, e in order:
                hc = h[s:e]
                g = _chunk_grad(hc, weight, bias, targets[s:e], lse[s:e], grad_out[s:e], ctx.temperature, kept)
                kept = None
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(weight.dtype)
                if need_h:
                    grad_h[s:e] = g @ weight  # (n, C)
                if defer and first is None:
                    first = g
                elif need_w and not defer:
                    grad_w = _add_product(grad_w, g, hc)
                del g
        if defer:
            ctx.deferred.pending.append(_WeightGrad(first, order, h, weight, bias, targets, lse, grad_out,
                                                    ctx.temperature))
            grad_w = placeholder_grad(weight)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunk_grad(hc, weight, bias, tc, lse, grad_out, tau, logits=None):
    """d (sum_i grad_out_i logp_i) / d logits of one chunk (n, V) fp32, from its logits / tau (recomputed
    unless given: they are overwritten)."""
    gc = grad_out.float()
    if tau != 1.0:
        gc = gc / tau  # the chain rule through logits / tau
    if logits is None:
        logits = F.linear(hc, weight, bias).float()
        if tau != 1.0:
            logits.div_(tau)
    probs = logits.sub_(lse[:, None]).exp_()  # softmax (n, V)
    g = probs.mul_(-gc[:, None])  # -g_i softmax_i ...
    g[torch.arange(tc.shape[0], device=tc.device), tc] += gc  # ... + g_i onehot(t_i)
    return g


def _add_product(grad_w, g, hc):
    """grad_w + g^T hc (V, C) fp32; the first product makes it."""
    if grad_w is None:
        return (g.t() @ hc).float()
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), hc)  # in place: no temporary of the weight's size
    grad_w += (g.t() @ hc).float()
    return grad_w


class _WeightGrad:
    """A deferred head weight gradient (`_LinearTokenLogps`): the products of the backward's chunk order, the
    first from the kept chunk's softmax gradient, the others recomputed."""

    def __init__(self, first, order, h, weight, bias, targets, lse, grad_out, tau):
        self.first, self.order, self.h, self.weight, self.bias = first, order, h, weight, bias
        self.targets, self.lse, self.grad_out, self.tau = targets, lse, grad_out, tau

    def __call__(self, total: torch.Tensor | None) -> torch.Tensor:
        h, w = self.h, self.weight
        grad_w = None
        with torch.autocast(h.device.type, enabled=False):
            for s, e in self.order:
                if self.first is not None:
                    g, self.first = self.first, None
                else:
                    g = _chunk_grad(h[s:e], w, self.bias, self.targets[s:e], self.lse[s:e], self.grad_out[s:e],
                                    self.tau).to(w.dtype)
                grad_w = _add_product(grad_w, g, h[s:e])
                del g
        if grad_w is None:
            raise KilnError("the head's deferred weight gradient has no chunks to sum")
        grad_w = grad_w.to(w.dtype)
        return grad_w if total is None else total.add_(grad_w)


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
    deferred = getattr(weight, "deferred_grad", None)  # the weight as deferred_head gave it (not cast)
    return _LinearTokenLogps.apply(h, weight, bias, targets, rows, float(temperature), keep, deferred)


def exact_token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """TRL's computation on full logits (B, T, V): fp32 logits / temperature, log_softmax, the target's
    value (B, T); targets (B, T) must be valid ids everywhere (the caller masks what it does not score)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
