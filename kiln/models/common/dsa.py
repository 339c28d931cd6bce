"""DeepSeek Sparse Attention (DSA): the lightning indexer that picks each query's top-k keys.

As transformers 5 computes it (DeepseekV32Indexer; GLM-MoE-DSA differs only in interleaved rope):
  q = wq_b(q_resid) per head (H, D), k = LayerNorm(wk(x)) (one head, D); the first
  qk_rope_head_dim dims of each carry rotary positions (half-split, or interleaved pairs);
  score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * D**-0.5), w = weights_proj(x) * H**-0.5,
  all in float32; masked keys score -inf; the top min(index_topk, T) keys are kept.
The attention then masks every key outside that set. The indexer runs without gradients (its
weights are trained apart in DeepSeek's recipe, never through the LM loss), as in transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.rope import apply_rope, apply_rope_interleaved


class Indexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int,
                 topk: int, interleave: bool):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.topk = num_heads, head_dim, rope_dim, topk
        self.rope_fn = apply_rope_interleaved if interleave else apply_rope
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.softmax_scale = head_dim**-0.5

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """x (B, T, C), q_resid (B, T, q_lora_rank), mask (B, T, K) bool -> key indices (B, T, k) int32."""
        B, T, _ = x.shape
        split = [self.rope_dim, self.head_dim - self.rope_dim]
        q = self.wq_b(q_resid).view(B, T, self.num_heads, self.head_dim)  # (B, T, H, D)
        q_rot, q_pass = torch.split(q, split, dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # (B, T, 1, D)
        k_rot, k_pass = torch.split(k, split, dim=-1)
        q_rot, k_rot = self.rope_fn(q_rot, k_rot, *rope, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # (B, T, D)
        if cache is not None:
            k = cache.update_index(layer_idx, k)  # (B, K, D)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale  # (B, T, H, K)
        scores = F.relu(scores)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.num_heads**-0.5)  # (B, T, H)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, T, K)
        index_scores = index_scores.masked_fill(~mask, float("-inf"))  # padding and the future never win
        k_keep = min(self.topk, index_scores.shape[-1])
        return index_scores.topk(k_keep, dim=-1).indices.to(torch.int32)


def restrict_mask(mask: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, K) bool attention mask AND the indexer's choice (B, T, k): only the picked keys stay."""
    picked = torch.zeros(mask.shape[0], topk.shape[1], mask.shape[-1], dtype=torch.bool, device=mask.device)
    picked.scatter_(-1, topk.long(), True)
    return mask & picked.unsqueeze(1)
