"""Multi-head self-attention through torch's scaled_dot_product_attention.

Masks follow transformers' SDPA path exactly (for bit-identical outputs): a boolean
(B, 1, Q, K) mask where True means "attend", or None when nothing is padded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def bidirectional_mask(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """(B, K) 1/0 padding mask -> (B, 1, Q, K) bool, or None when every position is real."""
    if attention_mask is None:
        return None
    keep = attention_mask.bool()
    if bool(keep.all()):
        return None
    batch, kv_len = keep.shape
    return keep[:, None, None, :].expand(batch, 1, q_len, kv_len)


def sliding_window_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int, window: int,
                        device: torch.device) -> torch.Tensor | None:
    """Bidirectional local attention: query i sees real keys j with |i - j| <= window. (B, 1, T, T) bool.

    None (no mask) exactly where transformers' SDPA path skips it, unpadded and shorter than
    `window`: an all-True mask and no mask may take different SDPA kernels on some devices.
    """
    keep = None if attention_mask is None else attention_mask.bool()
    if (keep is None or bool(keep.all())) and seq_len < window:
        return None
    pos = torch.arange(seq_len, device=device)
    mask = ((pos[:, None] - pos[None, :]).abs() <= window)[None, None]  # (1, 1, T, T)
    if keep is not None:
        mask = mask & keep[:, None, None, :]
    return mask.expand(batch, 1, seq_len, seq_len)


class SelfAttention(nn.Module):
    """q/k/v projections, SDPA, output projection. Bias on every projection (encoder style)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the number of heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        shape = (B, T, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, scale=self.scaling
        )
        y = y.transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()  # (B, T, C)
        return self.o_proj(y)
