"""An untied input embedding whose gradient accumulates into one kept buffer instead of a new matrix each step.

torch's embedding backward makes its weight gradient dense: zeros of the whole (vocab x hidden) matrix with the
looked-up rows added, a new allocation every backward (297 MB in fp32 for 151,936 x 512). On CPU a block that
large comes fresh from the system each time (glibc maps it, and unmaps it when freed), so every step pays a page
fault per 4 KiB page while zeroing it: measured ~0.5 s of a reward model's ~0.6 s forward and backward here. A
model with no LM head (a reward model) has nothing else making that matrix. `KeptGradEmbedding`'s backward adds
the batch's rows (index_add_, the padding id left out, as torch's backward sums them) into a buffer it keeps:
when the weight's `.grad` is None (the optimizer's zero_grad dropped it) the buffer is zeroed in place and
becomes `.grad` again; when `.grad` is set (accumulating micro-batches, or zero_grad zeroed it) the rows are added
to it. One micro-batch's gradient is bitwise torch's; accumulated over micro-batches, each batch's rows go into
the running sum rather than into a fresh matrix added to it: the same terms in another association.

Autograd never sees a gradient for the weight (the lookup's backward returns None for it), so nothing that hooks
autograd's accumulation (DDP's reducer, FSDP, post-accumulate hooks) would see it: `keep_embedding_gradient` is
for an unwrapped, unsharded model, a plain float nn.Embedding that is not an LM head's weight.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["KeptGradEmbedding", "keep_embedding_gradient"]


class _KeptLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, owner: KeptGradEmbedding) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.owner = owner
        return F.embedding(ids, weight, owner.padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:  # grad (..., C)
        (ids,) = ctx.saved_tensors
        ctx.owner.add_rows(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None, None


class KeptGradEmbedding(nn.Embedding):
    """nn.Embedding whose weight gradient is summed into a kept buffer (module docstring)."""
    kept: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(ids)
        return _KeptLookup.apply(ids, self.weight, self)

    def add_rows(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add grad (N, C) at rows ids (N,) to the weight's gradient, taking the kept buffer when there is none."""
        w = self.weight
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, grad = ids[keep], grad[keep]
        if w.grad is None:
            kept = self.kept
            if kept is None or kept.shape != w.shape or kept.dtype != w.dtype or kept.device != w.device:
                kept = self.kept = torch.zeros_like(w, memory_format=torch.contiguous_format)
            else:
                kept.zero_()
            w.grad = kept
        w.grad.index_add_(0, ids, grad.to(w.grad.dtype))


def keep_embedding_gradient(embedding: nn.Module) -> bool:
    """Switch `embedding` to `KeptGradEmbedding` where it is a plain, trained float nn.Embedding (no max_norm, no
    scale_grad_by_freq, not sparse). The caller vouches the model is unwrapped, unsharded and the weight is no LM
    head's (module docstring). Returns whether it switched."""
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None or embedding.scale_grad_by_freq \
            or embedding.sparse or type(embedding.weight) is not nn.Parameter \
            or not embedding.weight.dtype.is_floating_point or not embedding.weight.requires_grad:
        return False
    embedding.__class__ = KeptGradEmbedding
    return True
