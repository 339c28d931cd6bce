"""Selective state-space (Mamba v1) pieces: the causal depthwise conv and two selective scans.

The scan computes, per channel i and state n,
    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t        y_t = <h_t, C_t> + D u_t,   out = y * silu(z)
with dt = softplus(dt_raw + dt_bias).

- `reference`: one time step at a time with the exact op order of transformers' PyTorch path
  (`slow_forward`), so logits and losses are bit-identical to it. Slow: T small autograd steps.
- `fast`: the same maths with the recurrence in one autograd Function whose backward is the
  reverse recurrence (g_t = dh_t + a_{t+1} g_{t+1}), so autograd sees one node instead of ~5T.
  On CPU the recurrence is a tight in-place loop (work-optimal, a few us per step); on other
  devices it is a Hillis-Steele parallel scan (log2 T passes), which suits wide hardware.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  act: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Depthwise conv over time that sees only the past: x (B, C, T), weight (C, 1, K) -> (B, C, T)."""
    T, K = x.shape[-1], weight.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, bias, padding=K - 1, groups=x.shape[1])[..., :T]  # drop the look-ahead
    if act is not None:
        out = act(out)
    return out.to(x.dtype)


def selective_scan_reference(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                             D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """u, dt, z (B, I, T); A (I, N); B, C (B, N, T); D, dt_bias (I,) -> y (B, I, T), step by step."""
    dtype = u.dtype
    dt = F.softplus(dt + dt_bias.to(dt.dtype)[..., None])  # (B, I, T)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # (B, T, N)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])  # (B, I, T, N)
    # The product order (dt * B) * u is transformers'; it decides the last bit of every state.
    drive = dt[..., None] * B[:, None].float() * u[..., None].float()  # (B, I, T, N)
    state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=dtype, device=u.device)  # (B, I, N)
    ys = []
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + drive[:, :, t]
        ys.append(torch.matmul(state.to(dtype), C[:, t, :, None])[..., 0])  # (B, I, N) @ (B, N, 1) -> (B, I)
    y = torch.stack(ys, dim=-1)  # (B, I, T)
    y = y + u * D[None, :, None]
    return y * F.silu(z)


# ---- fast path --------------------------------------------------------------------------------
def _recurrence_loop(a: torch.Tensor, b: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + b_t along dim 0 (reverse: h_t = a_t * h_{t+1} + b_t), in place into a new tensor."""
    h = torch.empty_like(b)
    T = b.shape[0]
    order = range(T - 1, -1, -1) if reverse else range(T)
    prev = None
    for t in order:
        if prev is None:
            h[t].copy_(b[t])
        else:
            torch.addcmul(b[t], a[t], h[prev], out=h[t])  # one fused kernel per step, no allocation
        prev = t
    return h


def _recurrence_parallel(a: torch.Tensor, b: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The same recurrence as a Hillis-Steele scan: log2(T) full-tensor passes, no per-step launches."""
    if reverse:
        return _recurrence_parallel(a.flip(0), b.flip(0)).flip(0)
    a, h = a.clone(), b.clone()
    k = 1
    while k < h.shape[0]:
        # After this pass h_t sums the drives of the last 2k steps and a_t is their total decay.
        h[k:] = torch.addcmul(h[k:], a[k:], h[:-k])
        a[k:] = a[k:] * a[:-k]
        k *= 2
    return h


@torch.no_grad()
def recurrence(a: torch.Tensor, b: torch.Tensor, reverse: bool = False, parallel: bool | None = None) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + b_t over dim 0 with h_{-1} = 0; loop on CPU, parallel scan elsewhere.

    A kernel, not differentiable itself: `LinearRecurrence` gives it its backward.
    """
    if parallel is None:
        parallel = a.device.type != "cpu"
    return (_recurrence_parallel if parallel else _recurrence_loop)(a, b, reverse)


class LinearRecurrence(torch.autograd.Function):
    """States of h_t = a_t h_{t-1} + b_t (dim 0 is time) with an analytic backward.

    With g_t = dL/dh_t (total): g_t = grad_t + a_{t+1} g_{t+1}, dL/db_t = g_t, dL/da_t = g_t h_{t-1}.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, parallel: bool | None = None) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        h = recurrence(a, b, parallel=parallel)
        ctx.save_for_backward(a, h)
        ctx.parallel = parallel
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        a, h = ctx.saved_tensors
        a_next = torch.zeros_like(a)
        a_next[:-1] = a[1:]  # g_t picks up the gradient flowing back from t+1 through a_{t+1}
        g = recurrence(a_next, grad_h.contiguous(), reverse=True, parallel=ctx.parallel)
        grad_a = torch.zeros_like(a)
        torch.mul(g[1:], h[:-1], out=grad_a[1:])  # h_{-1} = 0: a_0 gets no gradient
        return grad_a, g, None


def selective_scan_fast(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor,
                        parallel: bool | None = None) -> torch.Tensor:
    """Same signature and result as `selective_scan_reference` (to rounding), time-major inside."""
    dtype = u.dtype
    dt = F.softplus(dt + dt_bias.to(dt.dtype)[..., None])  # (B, I, T)
    dt_t = dt.permute(2, 0, 1).float().contiguous()  # (T, B, I): time-major so each step is one contiguous block
    u_t = u.permute(2, 0, 1).float()  # (T, B, I)
    decay = torch.exp(dt_t[..., None] * A)  # (T, B, I, N)
    drive = (dt_t * u_t)[..., None] * B.permute(2, 0, 1)[:, :, None, :].float()  # (T, B, I, N)
    h = LinearRecurrence.apply(decay, drive, parallel)  # (T, B, I, N)
    y = torch.matmul(h, C.permute(2, 0, 1)[..., None].float())[..., 0]  # (T, B, I, N) @ (T, B, N, 1) -> (T, B, I)
    y = y.permute(1, 2, 0).to(dtype)  # (B, I, T)
    y = y + u * D[None, :, None]
    return y * F.silu(z)


SCANS: dict[str, Callable[..., torch.Tensor]] = {
    "reference": selective_scan_reference,
    "fast": selective_scan_fast,
}
