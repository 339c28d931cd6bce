"""The causal-LM loss, in one place: next-token targets, the summed form, and transformers' mean.

`shift_labels` turns labels aligned with the inputs into next-token targets (token t predicts
t+1; the last position predicts nothing). `lm_loss_sum` is what training accumulates: the fp32
cross entropy summed over the non-ignored targets, and their count, so micro-batches and ranks
add up to one exact mean. `causal_lm_loss` is the mean a task model returns as `.loss` for
`labels=`, computed in the same order as transformers' causal-LM loss so the two are bit-identical.

The fast path (training, unless `[train] exact = true`): `fast_lm_loss_sum` takes the hidden states
and the head weight instead of logits, keeps only the positions with a target, and
`linear_cross_entropy` runs head and loss a chunk of rows at a time, forward and backward together,
so (tokens x vocab) fp32 logits never exist. Within fp32 rounding of the exact path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "fast_lm_loss_sum", "linear_cross_entropy", "lm_loss_sum", "shift_labels"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) next-token targets: labels[:, 1:] with IGNORE_INDEX at the last position."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross entropy summed over targets != IGNORE_INDEX, that count) for logits (B, T, V), targets (B, T)."""
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, (targets != IGNORE_INDEX).sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross entropy of token t+1 given tokens <= t, from unshifted labels (B, T).

    The order of operations is transformers' (upcast, shift, flatten, mean over the non-ignored),
    so a model's `.loss` equals theirs to the last bit.
    """
    targets = shift_labels(labels).view(-1).to(logits.device)  # (B*T,)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets, ignore_index=IGNORE_INDEX)


# ---- fast path: the head and the loss together, chunk by chunk ---------------------------------
# Rows per chunk are chosen so one chunk's fp32 logits stay near this many elements (64 MiB): large enough
# that each chunk's matmuls run at full speed, small beside the (vocab x hidden) gradient of a trained head.
CHUNK_ELEMENTS = 1 << 24



# ---- a chunked head loss's written-out gradient -------------------------------------------------
# The forward of a loss over (hidden states h, LM head weight, bias) computes dL/dh, dL/dW, dL/db chunk by chunk into
# these buffers (fp32 for the head's, which sums over every row); the backward only scales them (also
# kiln.train.divergence).


def head_grad_buffers(h: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool, need_b: bool
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Empty dL/dh (h's dtype, every row written), zeroed fp32 dL/dW and dL/db (summed into); None where not needed."""
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
    return grad_h, grad_w, grad_b


def keep_head_grads(ctx: Any, grads: tuple[torch.Tensor | None, ...], weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
    """Keep the forward's gradients (those not None) on an autograd Function's ctx for `kept_head_grads`."""
    ctx.save_for_backward(*(g for g in grads if g is not None))
    ctx.needs = tuple(g is not None for g in grads)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)


def kept_head_grads(ctx: Any, grad_out: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dL/dh, dL/dW, dL/db) the forward kept, times the incoming gradient, in h's / the weight's / the bias' dtype."""
    saved = iter(ctx.saved_tensors)
    # A summed loss is backpropagated with gradient 1: hand the kept gradients over as they are (autograd
    # copies what it keeps), so no second (vocab x hidden) buffer exists at the peak.
    one = float(grad_out) == 1.0

    def scaled(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (g if one else g * grad_out).to(dtype)

    need_h, need_w, need_b = ctx.needs
    return (scaled(next(saved), ctx.dtypes[0]) if need_h else None,
            scaled(next(saved), ctx.dtypes[0]) if need_w else None,
            scaled(next(saved), ctx.dtypes[1]) if need_b else None)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i W^T (+ b), t_i) over rows that all carry a target, never holding (rows x vocab) logits.

    Each chunk's logits are made, reduced to their log-sum-exp, and turned into their gradient at once
    (softmax minus one-hot), which goes straight into dL/dh (this chunk's rows) and dL/dW, dL/db
    (accumulated in fp32). The backward only scales what the forward kept by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, rows, need_h, need_w, need_b):  # h (N, C), weight (V, C), targets (N,)
        with torch.autocast(h.device.type, enabled=False):  # dtypes were settled by the caller
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h, grad_w, grad_b = head_grad_buffers(h, weight, need_h, need_w, need_b)
            for s in range(0, h.shape[0], rows):
                hc, tc = h[s:s + rows], targets[s:s + rows]  # (n, C), (n,)
                logits = F.linear(hc, weight, bias).float()  # (n, V)
                picked = logits.gather(1, tc[:, None]).squeeze(1)  # (n,) the targets' logits
                top = logits.amax(dim=-1)  # (n,)
                probs = logits.sub_(top[:, None]).exp_()  # exp(logit - max), in place: no second (n, V) buffer
                norm = probs.sum(dim=-1)  # (n,)
                total += (top + norm.log() - picked).sum()  # log-sum-exp minus the target's logit
                if not (need_h or need_w or need_b):
                    continue
                probs.div_(norm[:, None])  # softmax
                probs[torch.arange(tc.shape[0], device=tc.device), tc] -= 1.0  # d CE / d logits
                g = probs.to(weight.dtype)
                if need_h:
                    grad_h[s:s + rows] = g @ weight  # (n, C)
                if need_w and g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)  # (V, C), no temporary of the weight's size
                elif need_w:
                    grad_w += (g.t() @ hc).float()
                if need_b:
                    grad_b += probs.sum(0)
        keep_head_grads(ctx, (grad_h, grad_w, grad_b), weight, bias)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        return *kept_head_grads(ctx, grad_out), None, None, None, None, None


def head_operands(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The LM head's matmul operands in the dtype `nn.Linear` would run them in: the autocast dtype under
    autocast, else the weight's."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        return h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return (h.to(weight.dtype) if h.dtype != weight.dtype else h), weight, bias


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """fp32 sum over rows of cross_entropy(h W^T + b, targets) for h (N, C), weight (V, C), targets (N,)
    with no ignored entries, chunk by chunk: within fp32 rounding of `lm_loss_sum` on the full logits.

    Under autocast the matmuls run in the autocast dtype, as `nn.Linear` would; the loss is fp32.
    """
    if h.shape[0] == 0:
        return (h.sum() * 0.0 + weight.sum() * 0.0).float()  # no targets: a zero that still reaches the graph
    h, weight, bias = head_operands(h, weight, bias)
    rows = chunk_rows or max(1, min(h.shape[0], CHUNK_ELEMENTS // weight.shape[0]))
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h, weight, bias, targets, rows, grad and h.requires_grad,
                                     grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)


def fast_lm_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_loss_sum` from the hidden states (B, T, C) and the head weight (V, C): logits only at the
    positions whose target is not IGNORE_INDEX, and those a chunk at a time (`linear_cross_entropy`)."""
    keep = targets != IGNORE_INDEX  # (B, T)
    return linear_cross_entropy(hidden[keep], weight, targets[keep], bias), keep.sum()
