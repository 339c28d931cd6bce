"""The gated delta rule (Gated DeltaNet's token mixer), three ways.

Per value head, with a state S (d_k, d_v), decay g_t <= 0 (log space), write strength beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t
with q, k L2-normalised and q scaled by d_k^-0.5.

- `chunk_reference` / `recurrent_reference`: transformers' PyTorch fallbacks op for op (chunks of 64
  solved with a triangular solve, then a loop over chunks; token by token for decoding), so logits
  and gradients are bit-identical to it. Used by verify-export and the parity tests.
- `chunk_fast`: the same chunk-parallel WY form, but the whole rule is one autograd node whose
  backward is written out (a reverse loop over chunks carrying dL/dS, everything else batched over
  all chunks at once). Within fp32 rounding of the reference; for training. It also restarts the
  state where a packed row starts a new sample (`resets`), which the reference gets by slicing.

`set_fast(model, True)` switches every Gated DeltaNet layer of a model to the fast path.
"""

from __future__ import annotations

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


class _ChunkedDeltaRule(torch.autograd.Function):
    """Chunk-major inputs (C, N, L, D) float32 (q, k normalised, q scaled), beta and g (C, N, L), packed-row
    masks or None; returns (out (C, N, L, Dv), final state (N, Dk, Dv)). Chunk-major so that each step of
    the loop over chunks reads contiguous blocks."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, s0, masks):
        C, N, L, Dk = k.shape
        Dv = v.shape[-1]
        same, carry, tail = masks if masks is not None else (None, None, None)
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        strict = lower.tril(-1)  # strictly lower: the system's unit diagonal is implied
        keep = lower if same is None else lower & same
        cum = g.cumsum(-1)  # (C, N, L)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~keep, float("-inf")).exp()  # (C, N, L, L)
        e_q = cum.exp() if carry is None else cum.exp() * carry          # reads of the chunk-start state
        e_k = (cum[..., -1:] - cum).exp() if tail is None else (cum[..., -1:] - cum).exp() * tail
        gamma = e_q[..., -1].contiguous()                                 # (C, N) decay of the state over a chunk
        kb, vb = k * beta[..., None], v * beta[..., None]
        kbe = kb * e_q[..., None]
        attn = _mm(q, k.transpose(-1, -2)) * decay                                   # (C, N, L, L) lower
        n_sys = (_mm(kb, k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # strictly lower
        t_inv = _unit_lower_inverse(n_sys)
        u, w = _mm(t_inv, vb), _mm(t_inv, kbe)     # (C, N, L, Dv), (C, N, L, Dk)
        qe, ke = q * e_q[..., None], k * e_k[..., None]
        ke_t = ke.transpose(-1, -2).contiguous()   # (C, N, Dk, L)
        states = q.new_empty(C, N, Dk, Dv)         # the state entering each chunk
        v_new = torch.empty_like(u)
        s = q.new_zeros(N, Dk, Dv) if s0 is None else s0.to(q.dtype).clone()
        for c in range(C):  # the only sequential part: two small matmuls per chunk
            states[c] = s
            torch.baddbmm(u[c], w[c], s, alpha=-1, out=v_new[c])
            s = torch.baddbmm(s * gamma[c, :, None, None], ke_t[c], v_new[c])
        out = _mm(qe, states, add=_mm(attn, v_new))  # qe S + attn v_new
        ctx.save_for_backward(q, k, v, beta, kb, kbe, decay, t_inv, u, w, attn, qe, ke, e_q, e_k, gamma,
                              states, v_new, n_sys)
        ctx.meta = (s0 is not None, strict, keep)
        return out, s

    @staticmethod
    def backward(ctx, d_out, d_final):
        (q, k, v, beta, kb, kbe, decay, t_inv, u, w, attn, qe, ke, e_q, e_k, gamma, states, v_new,
         n_sys) = ctx.saved_tensors
        has_s0, strict, keep = ctx.meta
        C, N, L, Dk = k.shape
        Dv = v.shape[-1]
        do = d_out.contiguous()
        # reverse loop: dL/dS leaving chunk c -> the new-value gradients and dL/dS entering chunk c
        part_vn = _mm(attn.transpose(-1, -2), do)    # (C, N, L, Dv)
        part_s = _mm(qe.transpose(-1, -2), do)       # (C, N, Dk, Dv)
        ds = q.new_zeros(N, Dk, Dv) if d_final is None else d_final.clone()
        d_vn = torch.empty_like(v_new)
        ds_after = torch.empty_like(states)          # dL/dS leaving each chunk
        w_t = w.transpose(-1, -2).contiguous()
        for c in range(C - 1, -1, -1):
            ds_after[c] = ds
            torch.baddbmm(part_vn[c], ke[c], ds, out=d_vn[c])
            ds = torch.baddbmm(torch.addcmul(part_s[c], ds, gamma[c, :, None, None]), w_t[c], d_vn[c], alpha=-1)
        # everything else at once over all chunks
        states_t = states.transpose(-1, -2)
        d_qe, d_w = _mm(do, states_t), _mm(d_vn, states_t, alpha=-1)
        d_attn = _mm(do, v_new.transpose(-1, -2)).masked_fill(~keep, 0.0)
        d_ke = _mm(v_new, ds_after.transpose(-1, -2))
        d_gamma = (states * ds_after).sum((-1, -2))
        t_inv_t = t_inv.transpose(-1, -2)
        d_vb, d_kbe = _mm(t_inv_t, d_vn), _mm(t_inv_t, d_w)
        d_n = _mm(d_kbe, w.transpose(-1, -2), add=_mm(d_vb, u.transpose(-1, -2)), alpha=-1, beta=-1)
        d_n = d_n.masked_fill(~strict, 0.0)
        # cum enters through decay (i - j), e_q (+i), e_k (last - i) and gamma (last)
        e_attn, e_n = d_attn * attn, d_n * n_sys
        d_cum = e_attn.sum(-1) - e_attn.sum(-2) + e_n.sum(-1) - e_n.sum(-2)
        d_cum = d_cum + (d_qe * qe).sum(-1) + (d_kbe * kbe).sum(-1)
        f = (d_ke * ke).sum(-1)
        d_cum = d_cum - f
        d_cum[..., -1] += f.sum(-1) + d_gamma * gamma
        d_attn, d_n = d_attn * decay, d_n * decay  # through the decay factor of each score
        d_q = _mm(d_attn, k, add=d_qe * e_q[..., None])
        d_kb = _mm(d_n, k, add=d_kbe * e_q[..., None])
        d_k = _mm(d_n.transpose(-1, -2), kb, add=_mm(d_attn.transpose(-1, -2), q, add=d_ke * e_k[..., None]))
        d_k = torch.addcmul(d_k, d_kb, beta[..., None])
        d_v = d_vb * beta[..., None]
        d_beta = (d_vb * v).sum(-1) + (d_kb * k).sum(-1)
        d_g = d_cum.flip(-1).cumsum(-1).flip(-1)     # cum = cumsum(g)

        return d_q, d_k, d_v, d_beta, d_g, ds if has_s0 else None, None


def chunk_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
               resets: torch.Tensor | None = None, chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_reference`'s arguments and results (to fp32 rounding), plus `resets` (B, T) bool: True where a
    packed row starts a new sample, so the state restarts from zero there."""
    dtype = q.dtype
    B, T, hk, Dk = k.shape
    H, Dv = v.shape[-2:]
    if hk != H:  # each q/k head serves H // hk consecutive value heads
        q, k = q.repeat_interleave(H // hk, dim=2), k.repeat_interleave(H // hk, dim=2)
    work = torch.float64 if dtype == torch.float64 else torch.float32  # float64 only for gradcheck
    q = l2norm(q.to(work)) * Dk**-0.5
    k = l2norm(k.to(work))
    L = chunk_size
    C = -(-T // L)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, ...) -> (C, B*H, L, ...), one copy
        x = F.pad(x.to(work), (0, 0) * (x.dim() - 2) + (0, C * L - T))
        x = x.view(B, C, L, H, *x.shape[3:]).permute(1, 0, 3, 2, *range(4, x.dim() + 1))  # (C, B, H, L, ...)
        return x.reshape(C, B * H, L, *x.shape[4:])

    s0 = None if initial_state is None else initial_state.to(work).reshape(B * H, Dk, Dv)
    masks = None if resets is None else _chunk_masks(resets, B * H, C, L, H)
    out, state = _ChunkedDeltaRule.apply(chunks(q), chunks(k), chunks(v), chunks(beta), chunks(g), s0, masks)
    out = out.view(C, B, H, L, Dv).permute(1, 0, 3, 2, 4).reshape(B, C * L, H, Dv)[:, :T]
    out = out.to(dtype, memory_format=torch.contiguous_format)
    return out, state.view(B, H, Dk, Dv) if output_final_state else None


def set_fast(model: nn.Module, fast: bool = True) -> nn.Module:
    """Switch every Gated DeltaNet layer in `model` to the fast chunked rule (True) or the exact one (False)."""
    for m in model.modules():
        if hasattr(m, "fast_delta_rule"):
            m.fast_delta_rule = fast
    return model
