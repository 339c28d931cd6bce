"""Distillation divergences between a student's and a teacher's next-token distributions, from hidden states and LM
head weights, a chunk of positions at a time: neither model's (tokens x vocab) logits exist at once.

Per position, with s = log_softmax(student_logits / T) and t = log_softmax(teacher_logits / T) (TRL's GKD
`generalized_jsd_loss`, Eq. 1 of Agarwal et al.):
- beta = 0: forward KL, KL(teacher || student) = sum p_t (t - s);
- beta = 1: reverse KL, KL(student || teacher) = sum p_s (s - t);
- else the generalized JSD: m = log((1 - beta) p_s + beta p_t), beta KL(teacher || m) + (1 - beta) KL(student || m).
`linear_divergence` returns the fp32 sum over positions (the caller divides by the token count, as TRL's
"batchmean" over unmasked positions). Its gradient is written out: per chunk, d/ds of the divergence (g), then
through the log-softmax and temperature, dz = (g - p_s sum(g)) / T, straight into dL/dh and dL/dW (fp32), so the
backward only scales what the forward kept. The teacher gets no gradient.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from kiln.models.common.loss import (
    CHUNK_ELEMENTS,
    head_grad_buffers,
    head_operands,
    keep_head_grads,
    kept_head_grads,
)

__all__ = ["divergence", "linear_divergence"]


def _per_token(s: torch.Tensor, t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence per row (n,), d divergence / d s (n, V)) for log-probs s, t (n, V)."""
    ps = s.exp()
    if beta == 0.0:
        pt = t.exp()
        return (pt * (t - s)).sum(-1), -pt
    if beta == 1.0:
        return (ps * (s - t)).sum(-1), ps * (s - t + 1.0)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    pt = t.exp()
    d = beta * (pt * (t - m)).sum(-1) + (1.0 - beta) * (ps * (s - m)).sum(-1)
    return d, (1.0 - beta) * ps * (s - m)  # the mixture's own terms cancel: sum_v p_m dm/ds = (1 - beta) p_s


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
               temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence (...,) of two logits tensors (..., V), in fp32 (no gradient shortcut: autograd's)."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return _per_token(s, t, beta)[0]


class _LinearDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, th, tweight, tbias, beta, temperature, rows, need_h, need_w, need_b):
        with torch.autocast(h.device.type, enabled=False):  # dtypes were settled by the caller
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h, grad_w, grad_b = head_grad_buffers(h, weight, need_h, need_w, need_b)
            for a in range(0, h.shape[0], rows):
                hc = h[a:a + rows]  # (n, C)
                s = F.log_softmax(F.linear(hc, weight, bias).float() / temperature, dim=-1)  # (n, V)
                with torch.no_grad():
                    t = F.log_softmax(F.linear(th[a:a + rows], tweight, tbias).float() / temperature, dim=-1)
                d, g = _per_token(s, t, beta)
                total += d.sum()
                if not (need_h or need_w or need_b):
                    continue
                dz = (g - s.exp() * g.sum(-1, keepdim=True)) / temperature  # through log_softmax(z / T)
                dz = dz.to(weight.dtype)
                if need_h:
                    grad_h[a:a + rows] = dz @ weight
                if need_w:
                    grad_w.addmm_(dz.t().float(), hc.float())
                if need_b:
                    grad_b += dz.float().sum(0)
        keep_head_grads(ctx, (grad_h, grad_w, grad_b), weight, bias)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        return *kept_head_grads(ctx, grad_out), None, None, None, None, None, None, None, None, None


def linear_divergence(h: torch.Tensor, weight: torch.Tensor, teacher_h: torch.Tensor, teacher_weight: torch.Tensor,
                      *, beta: float, temperature: float = 1.0, bias: torch.Tensor | None = None,
                      teacher_bias: torch.Tensor | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """fp32 sum over rows of the divergence between softmax((h W^T + b) / T) (student, h (N, C), weight (V, C)) and
    the teacher's from teacher_h (N, C_t), teacher_weight (V, C_t); the student's hidden states and head get
    gradients, the teacher none. Under autocast the matmuls run in the autocast dtype."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.shape[0] != teacher_weight.shape[0] or h.shape[0] != teacher_h.shape[0]:
        raise ValueError(f"student rows {tuple(h.shape)} / head {tuple(weight.shape)} and teacher rows "
                         f"{tuple(teacher_h.shape)} / head {tuple(teacher_weight.shape)} must share rows and vocabulary")
    if h.shape[0] == 0:
        return (h.sum() * 0.0 + weight.sum() * 0.0).float()
    h, weight, bias = head_operands(h, weight, bias)
    teacher_h, teacher_weight, teacher_bias = head_operands(teacher_h.detach(), teacher_weight.detach(),
                                                            None if teacher_bias is None else teacher_bias.detach())
    rows = chunk_rows or max(1, min(h.shape[0], CHUNK_ELEMENTS // (4 * weight.shape[0])))  # s, t, their exps, g
    grad = torch.is_grad_enabled()
    return _LinearDivergence.apply(h, weight, bias, teacher_h, teacher_weight, teacher_bias, float(beta),
                                   float(temperature), rows, grad and h.requires_grad, grad and weight.requires_grad,
                                   grad and bias is not None and bias.requires_grad)
