"""The routed experts' fast training path (`Experts.fast`, flipped by common/fast.py `set_fast`).

The exact path (moe.py) runs transformers' op sequence under autograd. This one computes the same
function as one autograd node with a written-out backward, in another rounding order:
- the (token, slot) pairs are sorted by expert once; the forward saves the permutation, the sorted
  inputs and the gate/up projection, and the backward reuses them (no second sort, no autograd
  copies of gathered rows);
- the routing weight scales the (S, I) activation before the down projection, not its (S, C) output;
- a token's k slots are summed by `index_add_` straight from the sorted rows (no unsort copy), and
  the input's gradient comes back the same way;
- SiLU's derivative is one fused kernel (`silu_backward`);
- on CPU each expert's weight gradient is written into a buffer reused across steps once nothing
  else holds it (`GradBuffer`): a fresh (E, 2I, C) gradient costs as much in page faults as its
  matmul.
Within fp32 rounding of the exact path (tests/models/test_moe_fast.py).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kiln.models.common.grouped import grouped_linear


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many references hold t's storage (None where this torch cannot tell: then never reuse)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


class GradBuffer:
    """One weight's gradient memory, reused across backward passes on CPU.

    The gradient handed to autograd shares this buffer's storage; when `.grad` is later set to None
    (or accumulated into and dropped) only this object holds the storage again, and the next backward
    writes into it instead of faulting in fresh pages. While anything else holds it (a `.grad` still
    set, a tensor from `torch.autograd.grad`), a fresh buffer is taken, so no live tensor is overwritten.
    The price: the experts' gradient memory stays allocated between steps, even under
    `zero_grad(set_to_none=True)`. Off CPU the device's caching allocator already reuses memory:
    every call allocates.
    """

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.free_refs: int | None = 0  # the storage's use count when only `buf` holds it

    def take(self, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        b = self.buf
        refs = None if b is None else _storage_refs(b)
        if b is None or b.shape != shape or b.dtype != like.dtype or refs is None or self.free_refs is None \
                or refs > self.free_refs:
            b = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.buf, self.free_refs = b, _storage_refs(b)
        return b.detach()  # a new tensor on the same storage: autograd may adopt it as `.grad`


def _weight_grad(a: torch.Tensor, b: torch.Tensor, counts: list[int], out: torch.Tensor) -> torch.Tensor:
    """out[e] = a_e^T b_e for the row groups of a (S, P) and b (S, Q) -> out (E, P, Q); empty groups give 0."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n].t(), b[start:start + n], out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


def _slot_sum(rows: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
    """rows (S, C) in sorted order -> (n, C): each row added into its token's row (k slots per token)."""
    return rows.new_zeros(n, rows.size(-1)).index_add_(0, token, rows)


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, index, gate_up_proj, down_proj, buffers):
        N, k = index.shape  # x (N, C); index, weights (N, k); gate_up_proj (E, 2I, C); down_proj (E, C, I)
        E, I = gate_up_proj.size(0), down_proj.size(-1)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (S,) pairs grouped by expert
        counts = torch.bincount(flat, minlength=E)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        token = order.div(k, rounding_mode="floor")  # (S,) the token of each sorted pair
        xs = x.index_select(0, token).to(gate_up_proj.dtype)  # (S, C)
        ws = weights.reshape(-1).index_select(0, order)  # (S,)
        h = grouped_linear(xs, gate_up_proj, offsets)  # (S, 2I): [gate | up]
        a = F.silu(h[:, :I]).mul_(h[:, I:])  # (S, I)
        ys = grouped_linear((a * ws.unsqueeze(-1)).to(down_proj.dtype), down_proj, offsets)  # (S, C)
        ctx.save_for_backward(xs, h, a, ws, order, token, offsets, gate_up_proj, down_proj)
        ctx.k, ctx.counts, ctx.buffers, ctx.x_dtype = k, counts, buffers, x.dtype
        return _slot_sum(ys, token, N).to(x.dtype)  # (N, C)

    @staticmethod
    def backward(ctx, grad):
        xs, h, a, ws, order, token, offsets, gate_up_proj, down_proj = ctx.saved_tensors
        k, buffers = ctx.k, ctx.buffers
        I = down_proj.size(-1)
        counts = ctx.counts.tolist()
        gys = grad.index_select(0, token).to(down_proj.dtype)  # (S, C): d out / d ys, in sorted order
        d_aw = grouped_linear(gys, down_proj.transpose(-2, -1), offsets)  # (S, I)
        d_down = d_gate_up = d_weights = d_x = None
        if ctx.needs_input_grad[4]:
            aw = (a * ws.unsqueeze(-1)).to(gys.dtype)
            d_down = _weight_grad(gys, aw, counts, buffers[1].take(down_proj.shape, down_proj))
        if ctx.needs_input_grad[1]:
            d_ws = (d_aw * a).sum(dim=-1)  # (S,)
            d_weights = torch.empty_like(d_ws).index_copy_(0, order, d_ws).view(-1, k).to(ws.dtype)  # (N, k)
        d_a = d_aw.mul_(ws.unsqueeze(-1))
        gate, up = h[:, :I], h[:, I:]
        dh = torch.empty_like(h)  # (S, 2I): [d gate | d up]
        torch.mul(d_a, F.silu(gate), out=dh[:, I:])
        dh[:, :I] = torch.ops.aten.silu_backward(d_a * up, gate)
        if ctx.needs_input_grad[3]:
            d_gate_up = _weight_grad(dh, xs, counts, buffers[0].take(gate_up_proj.shape, gate_up_proj))
        if ctx.needs_input_grad[0]:
            dxs = grouped_linear(dh, gate_up_proj.transpose(-2, -1), offsets)  # (S, C)
            d_x = _slot_sum(dxs, token, grad.size(0)).to(ctx.x_dtype)
        return d_x, d_weights, None, d_gate_up, d_down, None


def routed_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, buffers: tuple[GradBuffer, GradBuffer]) -> torch.Tensor:
    """SiLU-gated stacked experts on x (N, C) routed by index/weights (N, k) -> (N, C), as one autograd node.

    Under autocast the inputs take the autocast dtype first (differentiably), as a matmul would.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dt = torch.get_autocast_dtype(device)
        x, gate_up_proj, down_proj = x.to(dt), gate_up_proj.to(dt), down_proj.to(dt)
    with torch.autocast(device, enabled=False):
        return _RoutedExperts.apply(x, weights, index, gate_up_proj, down_proj, buffers)
