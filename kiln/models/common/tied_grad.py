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

With `defer_head_grad` the same node also defers the head's weight gradient itself. A chunked head
(kiln.models.common.token_logps) that sees the weight came through `deferred_head` returns only the hidden
states' gradient at once and leaves its (vocab x hidden) weight gradient as work on the head's
`DeferredWeightGrad`, which the node runs when its backward comes: after the backbone's, whose saved
activations are freed by then. Made at the head's backward, that gradient (297 MB for 151,936 x 512 in fp32)
would be held beside every activation of the backbone. The price: the head's logits of every chunk but the
kept one are computed once more (the same products in the same order: the same bits), one more head matmul
over those rows per backward (DPO takes it: its goal is memory; GRPO, whose update is a small part of a step
that must be fast, does not). On CPU the node first hands the heap pages those activations freed back to the system
(`release_free_heap`): glibc keeps freed heap memory mapped (small and mid-sized blocks come from its heap,
and its adaptive mmap threshold sends blocks up to 32 MB there after the first ones are freed), so without
it the freed activations and the new gradient would both count in the process's resident memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from kiln.kernels.libc import glibc


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


class DeferredWeightGrad:
    """The weight-gradient work handed to a `deferred_head` node: each entry takes the gradient made so far
    (None at first) and returns it with its own part added."""

    def __init__(self) -> None:
        self.pending: list[Callable[[torch.Tensor | None], torch.Tensor]] = []


def placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """What a head that deferred its weight gradient returns for the weight: zeros of its shape, one element
    expanded (no memory)."""
    return weight.new_zeros(()).expand(weight.shape)


def _is_placeholder(grad: torch.Tensor) -> bool:
    return grad.dim() > 0 and all(s == 0 for s in grad.stride())


def release_free_heap() -> bool:
    """Return the free pages of glibc's heap to the system (`malloc_trim(0)`); whether it ran (Linux with
    glibc only). The memory stays free for the process to reuse; only the resident pages go."""
    trim = glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


class _AfterLookup(torch.autograd.Function):
    """The identity; made before the lookup, its backward runs after the lookup's, and runs the weight
    gradient work a chunked head deferred to it (module docstring)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, deferred: DeferredWeightGrad | None) -> torch.Tensor:
        ctx.deferred = deferred
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        pending = [] if ctx.deferred is None else ctx.deferred.pending
        if ctx.deferred is not None:
            ctx.deferred.pending = []
        if not pending:
            return grad, None
        if grad.device.type == "cpu":
            release_free_heap()  # the backbone's activations are freed: drop their pages before the gradient
        out = pending[0](None)
        for work in pending[1:]:
            out = work(out)
        if not _is_placeholder(grad):  # the weight had another use in the graph: its gradient is added
            out += grad
        return out, None


class CoalescedGradEmbedding(nn.Embedding):
    """nn.Embedding whose weight gradient comes back as the coalesced rows it looked up (module docstring)."""
    defer_head_grad = False  # set by coalesce_tied_gradient

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
    deferred = DeferredWeightGrad() if emb.defer_head_grad else None
    head = _AfterLookup.apply(emb.weight, deferred)
    if deferred is not None:
        head.deferred_grad = deferred  # a chunked head hands its weight gradient here (linear_token_logps)
    return head


def _dense(p: torch.Tensor) -> None:
    if p.grad is not None and p.grad.is_sparse:
        p.grad = p.grad.to_dense()


def coalesce_tied_gradient(model: nn.Module, defer_head_grad: bool = False) -> bool:
    """Switch a kiln causal LM's input embedding to `CoalescedGradEmbedding` where it is the LM head (tied),
    a plain float32 nn.Embedding (no max_norm, no scale_grad_by_freq) and trained. For an unsharded model
    (not under FSDP), after any DDP wrapping. `defer_head_grad`: a chunked head's weight gradient is made
    after the backbone's backward (module docstring). Returns whether it switched."""
    emb = _input_embedding(model)
    if type(emb) is not nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse \
            or type(emb.weight) is not nn.Parameter or emb.weight.dtype != torch.float32 \
            or not emb.weight.requires_grad:
        return False
    emb.__class__ = CoalescedGradEmbedding
    cast(CoalescedGradEmbedding, emb).defer_head_grad = defer_head_grad  # its class was switched just above
    emb.weight.register_post_accumulate_grad_hook(_dense)
    return True
