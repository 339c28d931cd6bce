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
    """Masks for packed rows, or Nones: `same` (N, C, L, L) i, j in one sample; `carry` (N, C, L) no restart
    since the chunk began; `tail` (N, C, L) position in the same sample as the chunk's last one."""
    if resets is None:
        return None, None, None
    r = F.pad(resets.long(), (0, C * L - resets.shape[-1])).repeat_interleave(heads, dim=0)  # (N, C*L)
    seg = r.cumsum(-1).view(n, C, L)
    before = torch.cat([seg[:, :1, :1] - r[:, None, :1], seg[:, :-1, -1:]], dim=1)  # sample of the token before each chunk
    same = seg[..., :, None] == seg[..., None, :]
    return same, seg == before, seg == seg[..., -1:]


class _ChunkedDeltaRule(torch.autograd.Function):
    """Inputs (N, T, D) float32, already normalised and scaled; returns (out (N, T, Dv), final state)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, s0, resets, heads: int, L: int):
        N, T, Dk = k.shape
        Dv = v.shape[-1]
        C = -(-T // L)
        pad = C * L - T
        q, k, v = (F.pad(x, (0, 0, 0, pad)).view(N, C, L, -1) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)).view(N, C, L) for x in (beta, g))
        same, carry, tail = _chunk_masks(resets, N, C, L, heads)
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        strict = lower.tril(-1)  # strictly lower: the solve's unit diagonal is implied
        keep = lower if same is None else lower & same
        cum = g.cumsum(-1)  # (N, C, L)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~keep, float("-inf")).exp()  # (N, C, L, L)
        e_q = cum.exp() if carry is None else cum.exp() * carry          # reads of the chunk-start state
        e_k = (cum[..., -1:] - cum).exp() if tail is None else (cum[..., -1:] - cum).exp() * tail
        gamma = e_q[..., -1]                                              # (N, C) decay of the state over a chunk
        kb, vb = k * beta[..., None], v * beta[..., None]
        kbe = kb * e_q[..., None]
        n_sys = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # (N, C, L, L) strictly lower
        eye = torch.eye(L, dtype=q.dtype, device=q.device)
        t_inv = torch.linalg.solve_triangular(n_sys + eye, eye.expand_as(n_sys), upper=False, unitriangular=True)
        u, w = t_inv @ vb, t_inv @ kbe             # (N, C, L, Dv), (N, C, L, Dk)
        attn = (q @ k.transpose(-1, -2)) * decay   # (N, C, L, L) lower
        qe, ke = q * e_q[..., None], k * e_k[..., None]
        ke_t = ke.transpose(-1, -2).contiguous()   # (N, C, Dk, L)
        states = q.new_empty(N, C, Dk, Dv)         # the state entering each chunk
        v_new = torch.empty_like(u)
        s = q.new_zeros(N, Dk, Dv) if s0 is None else s0.to(q.dtype).clone()
        for c in range(C):  # the only sequential part: two small matmuls per chunk
            states[:, c] = s
            vn = torch.baddbmm(u[:, c], w[:, c], s, alpha=-1)
            v_new[:, c] = vn
            s = torch.baddbmm(s * gamma[:, c, None, None], ke_t[:, c], vn)
        out = qe @ states + attn @ v_new           # (N, C, L, Dv)
        ctx.save_for_backward(q, k, v, beta, kb, vb, kbe, decay, t_inv, u, w, attn, qe, ke, e_q, e_k, gamma,
                              states, v_new, n_sys)
        ctx.meta = (T, L, s0 is not None, strict, lower if same is None else keep)
        return out.view(N, C * L, Dv)[:, :T], s

    @staticmethod
    def backward(ctx, d_out, d_final):
        (q, k, v, beta, kb, vb, kbe, decay, t_inv, u, w, attn, qe, ke, e_q, e_k, gamma, states, v_new,
         n_sys) = ctx.saved_tensors
        T, L, has_s0, strict, keep = ctx.meta
        N, C, _, Dk = k.shape
        Dv = v.shape[-1]
        do = F.pad(d_out, (0, 0, 0, C * L - T)).view(N, C, L, Dv)
        # reverse loop: dL/dS entering chunk c+1 -> the new-value gradients and dL/dS entering chunk c
        part_vn = attn.transpose(-1, -2) @ do        # (N, C, L, Dv)
        part_s = qe.transpose(-1, -2) @ do           # (N, C, Dk, Dv)
        ds = q.new_zeros(N, Dk, Dv) if d_final is None else d_final.clone()
        d_vn = torch.empty_like(v_new)
        ds_after = torch.empty_like(states)          # dL/dS leaving each chunk
        w_t = w.transpose(-1, -2).contiguous()
        for c in range(C - 1, -1, -1):
            ds_after[:, c] = ds
            dvn = torch.baddbmm(part_vn[:, c], ke[:, c], ds)
            d_vn[:, c] = dvn
            ds = torch.baddbmm(torch.addcmul(part_s[:, c], ds, gamma[:, c, None, None]), w_t[:, c], dvn, alpha=-1)
        # everything else at once over all chunks
        d_qe = do @ states.transpose(-1, -2)
        d_attn = (do @ v_new.transpose(-1, -2)).masked_fill(~keep, 0.0)
        d_ke = v_new @ ds_after.transpose(-1, -2)
        d_gamma = (states * ds_after).sum((-1, -2))
        d_w = -(d_vn @ states.transpose(-1, -2))
        t_inv_t = t_inv.transpose(-1, -2)
        d_vb, d_kbe = t_inv_t @ d_vn, t_inv_t @ d_w
        d_n = -(d_vb @ u.transpose(-1, -2) + d_kbe @ w.transpose(-1, -2)).masked_fill(~strict, 0.0)
        # cum enters through decay (i-j), e_q (+i), e_k (last - i) and gamma (last)
        e_attn, e_n = d_attn * attn, d_n * n_sys
        d_cum = e_attn.sum(-1) - e_attn.sum(-2) + e_n.sum(-1) - e_n.sum(-2)
        d_cum = d_cum + (d_qe * qe).sum(-1) + (d_kbe * kbe).sum(-1)
        f = (d_ke * ke).sum(-1)
        d_cum = d_cum - f
        d_cum[..., -1] += f.sum(-1) + d_gamma * gamma
        d_attn_raw, d_n_raw = d_attn * decay, d_n * decay
        d_q = d_attn_raw @ k + d_qe * e_q[..., None]
        d_kb = d_n_raw @ k + d_kbe * e_q[..., None]
        d_k = d_attn_raw.transpose(-1, -2) @ q + d_n_raw.transpose(-1, -2) @ kb + d_ke * e_k[..., None]
        d_k = d_k + d_kb * beta[..., None]
        d_v = d_vb * beta[..., None]
        d_beta = (d_vb * v).sum(-1) + (d_kb * k).sum(-1)
        d_g = d_cum.flip(-1).cumsum(-1).flip(-1)     # cum = cumsum(g)
        cut = (lambda x: x.reshape(N, C * L, *x.shape[3:])[:, :T])
        return (cut(d_q), cut(d_k), cut(d_v), cut(d_beta), cut(d_g), ds if has_s0 else None, None, None, None)


def chunk_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
               resets: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_reference`'s arguments and results (to fp32 rounding), plus `resets` (B, T) bool: True where a
    packed row starts a new sample, so the state restarts from zero there."""
    dtype = q.dtype
    B, T, _, Dk = k.shape
    H, Dv = v.shape[-2:]
    q, k, v, beta, g = _heads_first(q, k, v, beta, g)
    q = l2norm(q) * Dk**-0.5
    k = l2norm(k)
    flat = (lambda x: x.reshape(B * H, T, *x.shape[3:]))
    s0 = None if initial_state is None else initial_state.reshape(B * H, Dk, Dv)
    out, state = _ChunkedDeltaRule.apply(flat(q), flat(k), flat(v), flat(beta), flat(g), s0, resets, H, chunk_size)
    out = out.view(B, H, T, Dv).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, state.view(B, H, Dk, Dv) if output_final_state else None


def set_fast(model: nn.Module, fast: bool = True) -> nn.Module:
    """Switch every Gated DeltaNet layer in `model` to the fast chunked rule (True) or the exact one (False)."""
    for m in model.modules():
        if hasattr(m, "fast_delta_rule"):
            m.fast_delta_rule = fast
    return model
