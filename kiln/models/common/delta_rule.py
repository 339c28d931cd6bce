"""The gated delta rule (Gated DeltaNet's token mixer), three ways.

Per value head, with a state S (d_k, d_v), decay g_t <= 0 (log space), write strength beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t
with q, k L2-normalised and q scaled by d_k^-0.5.

- `chunk_reference` / `recurrent_reference`: transformers' PyTorch fallbacks op for op (chunks of 64
  solved with a triangular solve, then a loop over chunks; token by token for decoding), so logits
  and gradients are bit-identical to it. Used by verify-export and the parity tests.
- `chunk_fast`: the same chunk-parallel WY form, but the whole rule (L2 norms and layout included) is
  one autograd node whose backward is written out: the products with each chunk's state happen in
  the loops over chunks (forward, and reverse carrying dL/dS), the intra-chunk work batched over all
  chunks at once. Within fp32 rounding of the reference; for training. It also restarts the state
  where a packed row starts a new sample (`resets`), which the reference gets by slicing.

`set_fast(model, True)` switches every Gated DeltaNet layer of a model to the fast path.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q, k, v, beta, g):
    """(B, T, H, D) inputs -> (B, H, T, D) float32 with q/k heads repeated up to the value heads (GVA)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:  # each q/k head serves hv // hk consecutive value heads
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    return [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)]


# ---- reference paths (transformers' fallbacks, op for op) -------------------------------------
def chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                    chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k (B, T, Hk, Dk), v (B, T, H, Dv), g, beta (B, T, H) -> out (B, T, H, Dv), final state (B, H, Dk, Dv)."""
    dtype = q.dtype
    B, T, _, Dk = k.shape
    H, Dv = v.shape[-2:]
    q, k, v, beta, g = _heads_first(q, k, v, beta, g)
    q, k = l2norm(q), l2norm(k)
    q = q * Dk**-0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, H, -1, chunk_size)  # (B, H, C, L)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()  # (B, H, C, L, L)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    k_beta_decayed = k_beta * cum.exp().unsqueeze(-1)
    # the diagonal of `system` is never read: unitriangular
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta_decayed, upper=False, unitriangular=True)
    state = (torch.zeros(B, H, Dk, Dv, dtype=u.dtype, device=u.device) if initial_state is None
             else initial_state.to(u))
    out = torch.zeros_like(u)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, Dv)[:, :, :T]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, state if output_final_state else None


def recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token (decoding); same arguments and results as `chunk_reference`."""
    dtype = q.dtype
    B, T, _, Dk = k.shape
    H, Dv = v.shape[-2:]
    q, k, v, beta, g = _heads_first(q, k, v, beta, g)
    q, k = l2norm(q), l2norm(k)
    q = q / (Dk**0.5)  # a division here, a product in the chunked form: each matches its reference
    state = (torch.zeros(B, H, Dk, Dv, dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.to(v))
    out = torch.zeros_like(v)
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]
        memory = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)  # what the state already says for k_t
        delta = (v[:, :, t] - memory) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    out = out.transpose(1, 2).contiguous().to(dtype)
    return out, state if output_final_state else None


# ---- fast path: one autograd node ---------------------------------------------------------------
def _chunk_masks(resets: torch.Tensor | None, n: int, C: int, L: int, heads: int):
    """Masks for packed rows (chunk-major), or Nones: `same` (C, N, L, L) i, j in one sample; `carry` (C, N, L)
    no restart since the chunk began; `tail` (C, N, L) in the same sample as the chunk's last position."""
    if resets is None:
        return None, None, None
    r = F.pad(resets.long(), (0, C * L - resets.shape[-1])).repeat_interleave(heads, dim=0)  # (N, C*L)
    seg = r.cumsum(-1).view(n, C, L).transpose(0, 1)  # (C, N, L)
    first = (seg[:1, :, :1] - r[None, :, :1])           # the sample before the row's first token
    before = torch.cat([first, seg[:-1, :, -1:]], dim=0)  # the sample of the token before each chunk
    same = seg[..., :, None] == seg[..., None, :]
    return same, seg == before, seg == seg[..., -1:]


def _unit_lower_inverse(n: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + n)^-1 for strictly lower n (..., L, L): forward substitution inside blocks, then block products.

    Plain matmuls and row updates: batched triangular solves are erratic on CPU (seconds for some layouts).
    """
    L = n.shape[-1]
    b = block if L % block == 0 else L
    k = L // b
    eye = torch.eye(b, dtype=n.dtype, device=n.device)
    diag = torch.stack([-n[..., j * b:(j + 1) * b, j * b:(j + 1) * b] for j in range(k)], dim=-3)  # (..., k, b, b)
    for i in range(1, b):  # row i of each diagonal block's inverse from the rows above it
        row = diag[..., i, :i].clone()
        diag[..., i, :i] = row + (row.unsqueeze(-1) * diag[..., :i, :i]).sum(-2)
    diag = diag + eye
    out = torch.zeros_like(n)
    for j in range(k):
        out[..., j * b:(j + 1) * b, j * b:(j + 1) * b] = diag[..., j, :, :]
    for i in range(1, k):  # T_ij = -T_ii sum_{m=j..i-1} N_im T_mj, nearest block first
        rows = slice(i * b, (i + 1) * b)
        for j in range(i - 1, -1, -1):
            cols = slice(j * b, (j + 1) * b)
            acc = n[..., rows, j * b:i * b] @ out[..., j * b:i * b, cols]
            out[..., rows, cols] = -(diag[..., i, :, :] @ acc)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None, alpha: float = 1.0,
        beta: float = 1.0) -> torch.Tensor:
    """beta * add + alpha * a @ b over (C, N, ...) batches as one bmm/baddbmm (transposed views are not copied)."""
    a3, b3 = a.flatten(0, 1), b.flatten(0, 1)
    if add is None:
        out = torch.bmm(a3, b3)
        out = out if alpha == 1.0 else out.mul_(alpha)
        return out.view(*a.shape[:2], *out.shape[1:])
    out = torch.baddbmm(add.flatten(0, 1), a3, b3, beta=beta, alpha=alpha)
    return out.view(*a.shape[:2], *out.shape[1:])


def _to_chunks(x: torch.Tensor, L: int, rep: int = 1, factor: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, h, ...) -> chunk-major (C, B*h*rep, L, ...) in one pass: each head repeated `rep` times (GVA),
    times `factor` (B, T, h, 1) if given, the last chunk zero-padded."""
    if x.dim() == 3:  # (B, T, h): per-position scalars
        return _to_chunks(x[..., None], L, rep)[..., 0]
    B, T, h, D = x.shape
    C, full = -(-T // L), T // L
    out = (x.new_empty if full == C else x.new_zeros)(C, B, h, rep, L, D)
    tail = T - full * L
    for n, t0, span, dst in ((full, 0, L, out[:full]), (1 if tail else 0, full * L, tail, out[full:, :, :, :, :tail])):
        if n == 0:
            continue

        # B023 is silenced below: view() runs only inside the iteration that defines it (this iteration's n, t0, span)
        def view(t: torch.Tensor) -> torch.Tensor:  # (B, T, h, d) -> (n, B, h, 1, span, d) over [t0, t0 + n*span)
            return t[:, t0:t0 + n * span].view(B, n, span, h, -1).permute(1, 0, 3, 2, 4).unsqueeze(3)  # noqa: B023

        if factor is None:
            dst.copy_(view(x).expand_as(dst))
        else:
            torch.mul(view(x).expand_as(dst), view(factor).expand(*dst.shape[:-1], 1), out=dst)
    return out.view(C, B * h * rep, L, D)


def _from_chunks(x: torch.Tensor, B: int, T: int, h: int, rep: int = 1) -> torch.Tensor:
    """The inverse of `_to_chunks` for gradients: (C, B*h*rep, L, ...) -> (B, T, h, ...), summed over repeats."""
    C, _, L = x.shape[:3]
    rest = x.shape[3:]
    x = x.view(C, B, h, rep, L, *rest)
    x = x[:, :, :, 0] if rep == 1 else x.sum(3)  # (C, B, h, L, ...)
    x = x.permute(1, 0, 3, 2, *range(4, x.dim())).reshape(B, C * L, h, *rest)
    return x[:, :T]


def _l2norm_backward(x: torch.Tensor, r: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """y = x * r with r = c / |x| (as rsqrt(|x|^2 + eps), times a constant c): dL/dx from dL/dy."""
    c2 = (x * x).sum(-1, keepdim=True).add_(1e-6).mul_(r * r)  # c^2 as the forward computed it
    dot = (x * dy).sum(-1, keepdim=True)
    return torch.addcmul(dy * r, x, dot.mul_(r.pow(3)).div_(c2), value=-1.0)


class _ChunkedDeltaRule(torch.autograd.Function):
    """The whole fast rule as one node: raw q, k (B, T, Hk, Dk), v (B, T, H, Dv), g, beta (B, T, H) float32,
    the state s0 (N, Dk, Dv) or None, packed-row masks or None, the chunk size -> (out (B, T, H, Dv),
    final state (N, Dk, Dv)). The L2 norms, the head repeat and the chunk-major layout (C, N, L, D), in which
    each step of the loop over chunks reads contiguous blocks, are inside it, so the backward writes each
    gradient in one pass instead of autograd chaining copies."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, masks, L):
        B, T, Hk, Dk = k.shape
        H, Dv = v.shape[-2:]
        rep = H // Hk
        rq = torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * Dk**-0.5  # q: unit length, then scaled
        rk = torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        qn, kn = _to_chunks(q, L, rep, rq), _to_chunks(k, L, rep, rk)  # (C, N, L, Dk)
        vc, bc, gc = _to_chunks(v, L), _to_chunks(beta, L), _to_chunks(g, L)  # (C, N, L, Dv), (C, N, L)
        C, N = qn.shape[:2]
        same, carry, tail = masks if masks is not None else (None, None, None)
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        keep = lower if same is None else lower & same
        strict = keep & ~torch.eye(L, dtype=torch.bool, device=q.device)  # the system's unit diagonal is implied
        cum = gc.cumsum(-1)  # (C, N, L)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~keep, float("-inf")).exp_()  # (C, N, L, L)
        e_q = cum.exp() if carry is None else cum.exp() * carry          # reads of the chunk-start state
        e_k = (cum[..., -1:] - cum).exp() if tail is None else (cum[..., -1:] - cum).exp() * tail
        gamma = e_q[..., -1].contiguous()                                 # (C, N) decay of the state over a chunk
        attn = _mm(qn, kn.transpose(-1, -2)).mul_(decay)                   # (C, N, L, L) lower
        kkd = _mm(kn, kn.transpose(-1, -2)).mul_(decay).masked_fill_(~strict, 0.0)  # strictly lower
        t_inv = _unit_lower_inverse(kkd * bc[..., :, None])               # (I + diag(beta) kkd)^-1
        tb = t_inv * bc[..., None, :]
        u = _mm(tb, vc)                                   # T diag(beta) v            (C, N, L, Dv)
        w = _mm(tb.mul_(e_q[..., None, :]), kn)           # T diag(beta e_q) k        (C, N, L, Dk)
        ke_t = torch.mul(kn.transpose(-1, -2), e_k[..., None, :], out=q.new_empty(C, N, Dk, L))
        states = q.new_empty(C + 1, N, Dk, Dv)    # the state entering each chunk, then the final one
        if s0 is None:
            states[0].zero_()
        else:
            states[0].copy_(s0)
        v_new, out = torch.empty_like(u), torch.empty_like(u)
        for c in range(C):  # the sequential part, each state read while it is in cache
            torch.baddbmm(u[c], w[c], states[c], alpha=-1, out=v_new[c])
            torch.bmm(qn[c], states[c], out=out[c])
            torch.mul(states[c], gamma[c, :, None, None], out=states[c + 1]).baddbmm_(ke_t[c], v_new[c])
        final = states[C]
        states = states[:C]
        out = _mm(attn, v_new, add=out.mul_(e_q[..., None]))  # e_q * (q S) + attn v_new
        ctx.save_for_backward(q, k, rq, rk, qn, kn, vc, bc, e_q, e_k, gamma, decay, attn, kkd, t_inv, w, ke_t,
                              states, v_new)
        ctx.meta = (s0 is not None, keep, strict, B, T, Hk, H)
        return _from_chunks(out, B, T, H), final.clone()

    @staticmethod
    def backward(ctx, d_out, d_final):
        (q, k, rq, rk, qn, kn, vc, bc, e_q, e_k, gamma, decay, attn, kkd, t_inv, w, ke_t, states,
         v_new) = ctx.saved_tensors
        has_s0, keep, strict, B, T, Hk, H = ctx.meta
        C, N, L, Dk = kn.shape
        Dv = vc.shape[-1]
        do = _to_chunks(d_out, L)                     # (C, N, L, Dv)
        doe = do * e_q[..., None]
        # reverse loop over chunks carrying ds = dL/dS leaving chunk c; every product with a state or with ds
        # happens here, on blocks still in cache (no (C, N, Dk, Dv) gradient buffer). v_new = T (v beta -
        # k beta e_q S), so with d_vb = T^T d_vn the k-side gradient is -d_vb S^T and the system's d_vb v_new^T
        part_vn = _mm(attn.transpose(-1, -2), do)     # (C, N, L, Dv)
        ds = q.new_zeros(N, Dk, Dv) if d_final is None else d_final.clone()
        d_vn, d_vb = torch.empty_like(v_new), torch.empty_like(v_new)
        d_ke, m_kbe, d_qn = torch.empty_like(kn), torch.empty_like(kn), torch.empty_like(kn)
        d_gamma = q.new_empty(C, N)
        for c in range(C - 1, -1, -1):
            s, s_t = states[c], states[c].transpose(-1, -2)
            torch.baddbmm(part_vn[c], ke_t[c].transpose(-1, -2), ds, out=d_vn[c])
            torch.bmm(v_new[c], ds.transpose(-1, -2), out=d_ke[c])
            torch.sum(s * ds, (-1, -2), out=d_gamma[c])
            torch.bmm(t_inv[c].transpose(-1, -2), d_vn[c], out=d_vb[c])
            torch.bmm(d_vb[c], s_t, out=m_kbe[c])    # minus dL/d(k beta e_q)
            torch.bmm(doe[c], s_t, out=d_qn[c])      # e_q * (dL/dout S^T)
            part = torch.bmm(qn[c].transpose(-1, -2), doe[c])
            ds = torch.addcmul(part, ds, gamma[c, :, None, None]).baddbmm_(w[c].transpose(-1, -2), d_vn[c], alpha=-1)
        d_s0 = ds
        d_attn = _mm(do, v_new.transpose(-1, -2)).masked_fill_(~keep, 0.0)
        d_n = _mm(d_vb, v_new.transpose(-1, -2), alpha=-1).masked_fill_(~strict, 0.0)  # wrt diag(beta) kkd
        # g_t enters cum_i for i >= t: through e_q (cum_i), e_k (cum_last - cum_i), gamma (cum_last) and each
        # decay (cum_i - cum_j), which holds g_t exactly when i >= t > j. Summed that way, not as differences
        # of row and column totals, so the large decay terms never cancel in float32.
        dnk = d_n * kkd
        d_beta = dnk.sum(-1)
        e_dec = dnk.mul_(bc[..., :, None]).add_(d_attn * attn)   # dL/d(decay exponent) per score
        below = e_dec.flip(-2).cumsum(-2).flip(-2).cumsum(-1)     # [t, s]: rows i >= t, columns j <= s
        p_kbe = -(m_kbe * kn).sum(-1)                             # dL/d(beta e_q) per position
        f = (d_ke * kn).sum(-1).mul_(e_k)
        d_e = (d_qn * qn).sum(-1) + p_kbe * bc * e_q
        d_g = d_e.flip(-1).cumsum(-1).flip(-1) + (f.cumsum(-1) - f) + (d_gamma * gamma)[..., None]
        d_g[..., 1:] += below.diagonal(-1, -2, -1)
        d_beta += (d_vb * vc).sum(-1) + p_kbe * e_q
        d_attn.mul_(decay)                                        # through the decay factor of each score
        sym = d_n.mul_(decay).mul_(bc[..., :, None])              # dL/d(k k^T) from the system, both ways
        sym = sym + sym.transpose(-1, -2)
        d_qn = _mm(d_attn, kn, add=d_qn)
        d_kn = _mm(sym, kn, add=_mm(d_attn.transpose(-1, -2), qn, add=d_ke.mul_(e_k[..., None])))
        d_kn.addcmul_(m_kbe, (bc * e_q)[..., None], value=-1.0)
        d_q = _l2norm_backward(q, rq, _from_chunks(d_qn, B, T, Hk, H // Hk))
        d_k = _l2norm_backward(k, rk, _from_chunks(d_kn, B, T, Hk, H // Hk))
        d_v = _from_chunks(d_vb.mul_(bc[..., None]), B, T, H)
        return (d_q, d_k, d_v, _from_chunks(d_g, B, T, H), _from_chunks(d_beta, B, T, H),
                d_s0 if has_s0 else None, None, None)


def chunk_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
               resets: torch.Tensor | None = None, chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_reference`'s arguments and results (to fp32 rounding), plus `resets` (B, T) bool: True where a
    packed row starts a new sample, so the state restarts from zero there."""
    dtype = q.dtype
    B, T, _, Dk = k.shape
    H, Dv = v.shape[-2:]
    work = torch.float64 if dtype == torch.float64 else torch.float32  # float64 only for gradcheck
    L = chunk_size
    C = -(-T // L)
    s0 = None if initial_state is None else initial_state.to(work).reshape(B * H, Dk, Dv)
    masks = None if resets is None else _chunk_masks(resets, B * H, C, L, H)
    out, state = _ChunkedDeltaRule.apply(q.to(work), k.to(work), v.to(work), g.to(work), beta.to(work), s0, masks, L)
    out = out.to(dtype, memory_format=torch.contiguous_format)
    return out, state.view(B, H, Dk, Dv) if output_final_state else None


class _DeltaRuleSwitch(Protocol):
    fast_delta_rule: bool  # a Gated DeltaNet layer's (common/hybrid.py)


def set_fast(model: nn.Module, fast: bool = True) -> nn.Module:
    """Switch every Gated DeltaNet layer in `model` to the fast chunked rule (True) or the exact one (False)."""
    for m in model.modules():
        if hasattr(m, "fast_delta_rule"):
            cast(_DeltaRuleSwitch, m).fast_delta_rule = fast  # cast: the hasattr above found the switch
    return model
