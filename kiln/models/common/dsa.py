"""DeepSeek Sparse Attention (DSA): the lightning indexer that picks each query's top-k keys.

As transformers 5 computes it (DeepseekV32Indexer; GLM-MoE-DSA differs only in interleaved rope):
  q = wq_b(q_resid) per head (H, D), k = LayerNorm(wk(x)) (one head, D); the first
  qk_rope_head_dim dims of each carry rotary positions (half-split, or interleaved pairs);
  score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * D**-0.5), w = weights_proj(x) * H**-0.5,
  all in float32; masked keys score -inf; the top min(index_topk, T) keys are kept.
The attention then masks every key outside that set. The indexer runs without gradients (its
weights are trained apart in DeepSeek's recipe, never through the LM loss), as in transformers, and
its parameters are built frozen (requires_grad False). `train_kl` (set by the `[moe] indexer = "kl"`
training switch) makes the attention score the indexer on detached inputs, with gradients, against
its own distribution (`indexer_kl`), so the indexer learns from that loss alone: the mean over the
queries, under context parallelism over the whole rows' (each cp rank's loss is its share of that mean).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.rope import apply_rope, apply_rope_interleaved


class RowContext(Protocol):
    """What context parallelism (kiln.parallel.context.ContextParallel) gives latent attention and its indexer: the
    whole row's latent, rope and indexer keys gathered from the cp ranks, the row's mask, counts summed over them."""
    mask: torch.Tensor | None  # (B or 1, 1, T/cp, T) for the forward under way

    def gather_latent(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gather_keys(self, k: torch.Tensor) -> torch.Tensor: ...
    def group_sum(self, x: torch.Tensor) -> torch.Tensor: ...


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
        self.requires_grad_(False)  # the LM loss never reaches it (top-k is not differentiable); see train_kl
        self.train_kl = False
        self.context: RowContext | None = None  # context parallelism: its keys gathered over the cp ranks
        self.loss: torch.Tensor | None = None  # the last training forward's KL, when train_kl

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """x (B, T, C), q_resid (B, T, q_lora_rank), mask (B, T, K) bool -> key indices (B, T, k) int32."""
        return self.pick(self.scores(x, q_resid, rope, mask, cache, layer_idx))

    def pick(self, index_scores: torch.Tensor) -> torch.Tensor:
        """The top min(index_topk, K) keys of each query (B, T, k) int32."""
        k_keep = min(self.topk, index_scores.shape[-1])
        return index_scores.detach().topk(k_keep, dim=-1).indices.to(torch.int32)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """Index scores (B, T, K) float32, -inf where `mask` (B, T, K) forbids a key."""
        B, T, _ = x.shape
        split = [self.rope_dim, self.head_dim - self.rope_dim]
        q = self.wq_b(q_resid).view(B, T, self.num_heads, self.head_dim)  # (B, T, H, D)
        q_rot, q_pass = torch.split(q, split, dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # (B, T, 1, D)
        k_rot, k_pass = torch.split(k, split, dim=-1)
        q_rot, k_rot = self.rope_fn(q_rot, k_rot, *rope, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # (B, T, D)
        if self.context is not None:
            k = self.context.gather_keys(k)  # (B, K, D): the whole row's, for this rank's queries
        if cache is not None:
            k = cache.update_index(layer_idx, k)  # (B, K, D)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale  # (B, T, H, K)
        scores = F.relu(scores)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.num_heads**-0.5)  # (B, T, H)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, T, K)
        return index_scores.masked_fill(~mask, float("-inf"))  # padding and the future never win


def indexer_kl(index_scores: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(Sum over queries of KL(target || softmax(index_scores)) over the keys `mask` allows, how many queries).

    index_scores (B, T, K) (-inf outside `mask`), target (B, T, K) a distribution over the allowed
    keys (the main attention's, summed over heads and renormalised), mask (B, T, K) bool. Queries
    with no allowed key (padding) are left out of both. The loss is the mean: sum / count."""
    log_q = torch.log_softmax(index_scores.float(), dim=-1).masked_fill(~mask, 0.0)
    p = target.float().masked_fill(~mask, 0.0)
    per_query = (torch.xlogy(p, p) - p * log_q).sum(-1)  # (B, T); 0 * log 0 = 0
    rows = mask.any(-1)
    return per_query[rows].sum(), rows.sum()


def restrict_mask(mask: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, K) bool attention mask AND the indexer's choice (B, T, k): only the picked keys stay."""
    picked = torch.zeros(mask.shape[0], topk.shape[1], mask.shape[-1], dtype=torch.bool, device=mask.device)
    picked.scatter_(-1, topk.long(), True)
    return mask & picked.unsqueeze(1)
