"""The tied input embedding's gradient as the rows a batch looked up, added into the LM head's in place.

With tied weights the LM head is the input embedding, so autograd gets two gradients for one (vocab x hidden)
matrix: the head's, dense, and the lookup's, which torch's embedding backward also makes dense (zeros of the
matrix's size with the looked-up rows added) before the two are added: a transient second copy of the matrix
(297 MB in fp32 for 151,936 x 512) at the end of every backward, and passes over it.

`coalesce_tied_gradient` switches the lookup to a backward that returns a coalesced sparse gradient: each
distinct id's rows summed from zero in token order (index_add_, as the dense backward sums them), the padding
id left out (as it leaves it). Autograd adds a sparse gradient into a dense one in place only when the sparse
one arrives first, so the head takes the weight through `deferred_head`: an identity made before the lookup,
whose backward autograd therefore runs after the lookup's (it runs the later-made of two ready nodes first).
Every element of the gradient is the same sum as before; in whichever order they arrive, only the memory
differs. Where the head's gradient would never come (a loss that skips the head), a hook makes `.grad` dense.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class _CoalescedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad (..., C)
        (ids,) = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, grad = ids[keep], grad[keep]
        rows, inverse = torch.unique(ids, return_inverse=True)  # sorted distinct ids (U,), each token's row
        values = grad.new_zeros(rows.shape[0], grad.shape[1]).index_add_(0, inverse, grad)  # (U, C)
        with torch.sparse.check_sparse_tensor_invariants(False):  # sorted and distinct by construction
            sparse = torch.sparse_coo_tensor(rows[None], values, ctx.shape, is_coalesced=True)
        return None, sparse, None


class _AfterLookup(torch.autograd.Function):
    """The identity; made before the lookup, its backward runs after the lookup's."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CoalescedGradEmbedding(nn.Embedding):
    """nn.Embedding whose weight gradient comes back as the coalesced rows it looked up (module docstring)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(ids)
        return _CoalescedLookup.apply(ids, self.weight, self.padding_idx)


def _input_embedding(model: nn.Module) -> nn.Module | None:
    """A kiln ForCausalLM's tied input embedding (its LM head), else None."""
    name = getattr(model, "embedding", None)
    if not isinstance(name, str) or getattr(model, "lm_head", True) is not None:
        return None
    return getattr(getattr(model, "model", None), name, None)


def deferred_head(model: nn.Module) -> torch.Tensor | None:
    """The tied head's weight for this forward, to take before the backbone runs, when the model's embedding
    is coalesced and a gradient is coming; None otherwise (use the weight itself)."""
    emb = _input_embedding(model)
    if not isinstance(emb, CoalescedGradEmbedding) or not (torch.is_grad_enabled() and emb.weight.requires_grad):
        return None
    return _AfterLookup.apply(emb.weight)


def _dense(p: torch.Tensor) -> None:
    if p.grad is not None and p.grad.is_sparse:
        p.grad = p.grad.to_dense()


def coalesce_tied_gradient(model: nn.Module) -> bool:
    """Switch a kiln causal LM's input embedding to `CoalescedGradEmbedding` where it is the LM head (tied),
    a plain float32 nn.Embedding (no max_norm, no scale_grad_by_freq) and trained. For an unsharded model
    (not under FSDP), after any DDP wrapping. Returns whether it switched."""
    emb = _input_embedding(model)
    if type(emb) is not nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse \
            or type(emb.weight) is not nn.Parameter or emb.weight.dtype != torch.float32 \
            or not emb.weight.requires_grad:
        return False
    emb.__class__ = CoalescedGradEmbedding
    emb.weight.register_post_accumulate_grad_hook(_dense)
    return True
