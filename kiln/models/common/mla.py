"""Multi-head latent attention (DeepSeek-V2/V3 MLA) and the pre-norm decoder built on it.

As transformers 5 computes it (DeepseekV3Attention):
  q      = q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x))) with a q_lora_rank         (B, H, T, nope + rope)
  latent, k_rope = kv_a_proj_with_mqa(x)          (kv_lora_rank | qk_rope_head_dim, one head for all)
  k_nope, v = kv_b_proj(RMSNorm(latent)) per head;  k = [k_nope | k_rope]
Only the last qk_rope_head_dim dims of q and k carry rotary positions (adjacent pairs when
interleaved). The cache holds the normalised latent and the rotated k_rope (B, 1, S, .), i.e.
kv_lora_rank + qk_rope_head_dim numbers per token and layer, never per-head keys and values.
Softmax scale: (nope + rope)**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN.
With a sparse-attention indexer (dsa.py) each query keeps only its top-k keys; GLM-5 layers may
reuse the previous layer's choice instead of running their own indexer. When the indexer trains
(`train_kl`), a training forward also leaves its KL loss against this attention's distribution.

Decoding has a fast path (`fast`, flipped with the others by common/fast.py set_fast): kv_b_proj
is folded into the query and the output, so a one-token step attends over the cached latent
directly instead of re-expanding every cached token into per-head keys and values (the exact path,
as transformers does). Same maths in another summation order: within float rounding, not bit-equal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.common.decoder import KVCache, positions_and_mask
from kiln.models.common.dsa import Indexer, RowContext, indexer_kl, restrict_mask
from kiln.models.common.norms import RMSNorm
from kiln.models.common.rope import RotaryEmbedding, apply_rope, apply_rope_interleaved, yarn_mscale


@dataclass(frozen=True)
class MLASpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None      # None: one q_proj, no low-rank query path
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float               # softmax scale (see `softmax_scale`)
    bias: bool = False           # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    interleave: bool = True      # rope dims as adjacent pairs (DeepSeek) vs halves (Llama)
    dropout: float = 0.0
    sparse: str | None = None    # None, "full" (own indexer) or "shared" (the previous layer's top-k)
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_interleave: bool = False


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 for a scaled rope that names mscale_all_dim."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


class MLACache(KVCache):
    """Per layer: `keys` hold the normalised latent (B, 1, S, kv_lora_rank), `values` the rotated
    shared rope key (B, 1, S, qk_rope_head_dim); `index_keys` the indexer's keys (B, S, D)."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.index_keys: list[torch.Tensor | None] = [None] * num_layers

    def update_index(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        old = self.index_keys[layer]
        new = k if old is None else torch.cat([old, k], dim=1)
        self.index_keys[layer] = new
        return new

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self.index_keys = [None if k is None else k[index] for k in self.index_keys]


class MLAttention(nn.Module):
    def __init__(self, s: MLASpec, layer_idx: int):
        super().__init__()
        self.layer_idx, self.scaling, self.dropout, self.sparse = layer_idx, s.scaling, s.dropout, s.sparse
        self.fast = False  # on: one-token decode attends over the latent (_absorbed); off: the exact path
        self.nope, self.rope_dim, self.v_dim = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        self.rank = s.kv_lora_rank
        self.qk_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        self.rope_fn = apply_rope_interleaved if s.interleave else apply_rope
        q_out = s.num_heads * self.qk_head_dim
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(s.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(s.hidden_size, s.q_lora_rank, bias=s.bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank)  # eps 1e-6 whatever rms_norm_eps says, as in HF
            self.q_b_proj = nn.Linear(s.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=s.bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.v_head_dim, s.hidden_size, bias=s.bias)
        # context parallelism (kiln.parallel.context) sets it: this rank's queries attend over the whole row's
        # latent and rope keys, all-gathered (latent + rope numbers per token), under its global mask
        self.context: RowContext | None = None
        if s.sparse == "full":
            if s.q_lora_rank is None:
                raise KilnError("sparse attention's indexer reads the low-rank query: q_lora_rank must be set")
            self.indexer = Indexer(s.hidden_size, s.q_lora_rank, s.index_heads, s.index_head_dim, s.qk_rope_head_dim,
                                   s.index_topk, s.index_interleave)

    def expand_kv(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (B, 1, S, R), k_rot (B, 1, S, rope) -> keys (B, H, S, nope + rope), values (B, H, S, v)."""
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)  # (B, H, S, nope + v)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = kv.new_empty(*kv.shape[:-1], self.qk_head_dim)
        k[..., :self.nope].copy_(k_nope)
        k[..., self.nope:].copy_(k_rot.expand(-1, k_nope.shape[1], -1, -1))  # one rope key shared by every head
        return k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: MLACache | None = None, shared_topk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape  # (B, T, C)
        q_resid = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))  # (B, T, q_lora_rank): the indexer reads it too
            q = self.q_b_proj(q_resid)
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)  # (B, H, T, nope + rope)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, T, self.rank)
        k_rot = k_rot.view(B, 1, T, self.rope_dim)
        q_rot, k_rot = self.rope_fn(q_rot, k_rot, *rope)
        if cache is not None:  # the compressed latent is what is cached
            latent, k_rot = cache.update(self.layer_idx, latent, k_rot)
        if self.context is not None:  # (B, 1, T, R) and (B, 1, T, rope) of the whole row; mask (B, 1, T/cp, T)
            latent, k_rot = self.context.gather_latent(latent, k_rot)
            if self.context.mask is None:
                raise KilnError("context-parallel latent attention outside the model's forward: no row mask yet")
            mask = self.context.mask.expand(B, -1, -1, -1)
        topk = index_scores = None
        if self.sparse == "full":
            if mask is None or q_resid is None:
                raise KilnError(f"layer {self.layer_idx}: the indexer reads the attention mask and the low-rank query "
                                "(a sparse model's decoder always makes the mask; q_lora_rank must be set)")
            if self.indexer.train_kl and self.training:
                # scored with gradients on detached inputs: only the indexer loss reaches the indexer
                index_scores = self.indexer.scores(x.detach(), q_resid.detach(), rope, mask[:, 0], cache,
                                                   self.layer_idx)
                topk = self.indexer.pick(index_scores)
            else:
                topk = self.indexer(x, q_resid, rope, mask[:, 0], cache, self.layer_idx)
        elif self.sparse == "shared":
            if shared_topk is None:
                raise KilnError(f"layer {self.layer_idx} reuses the previous layer's sparse-attention choice, "
                                "but no earlier layer ran an indexer (indexer_types must start with 'full')")
            topk = shared_topk
        if topk is not None:
            if mask is None:
                raise KilnError(f"layer {self.layer_idx}: sparse attention restricts the attention mask; none was made")
            mask = restrict_mask(mask, topk)
        if self.fast and T == 1 and not self.training and type(self.kv_b_proj) is nn.Linear:
            y = self._absorbed(q_pass, q_rot, latent, k_rot, mask)
        else:
            q = torch.cat((q_pass, q_rot), dim=-1)
            k, v = self.expand_kv(latent, k_rot)
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scaling,
                                               is_causal=T > 1 and mask is None)  # (B, H, T, v)
            if index_scores is not None and mask is not None:  # (the indexer ran: a mask was made)
                self.indexer.loss = self._indexer_loss(q, k, mask, index_scores)
        y = y.transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()
        return self.o_proj(y), topk

    def _indexer_loss(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, index_scores: torch.Tensor
                      ) -> torch.Tensor:
        """KL from this attention's distribution (detached, summed over heads, renormalised) to the
        indexer's softmax, over the keys each query attends to (DeepSeek-V3.2's indexer loss), mean over queries."""
        with torch.no_grad():
            scores = (q.float() @ k.float().transpose(-1, -2)) * self.scaling  # (B, H, T, K)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
            target = probs.sum(1)  # (B, T, K)
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-20)
        kl_sum, queries = indexer_kl(index_scores, target, mask[:, 0])
        if self.context is not None:  # this rank's share of the mean over its cp group's queries (the whole rows)
            queries = self.context.group_sum(queries)
        return kl_sum / queries.clamp(min=1)

    def _absorbed(self, q_pass: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over the latent itself: q.k = (q_nope W_k) . latent + q_rot . k_rot; out = (p . latent) W_v^T."""
        w = self.kv_b_proj.weight.view(-1, self.nope + self.v_dim, self.rank)  # (H, nope + v, R)
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_pass, w[:, :self.nope])      # (B, H, T, R)
        scores = (q_lat @ latent.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scaling  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(latent.dtype)
        return torch.einsum("bhtr,hvr->bhtv", probs @ latent, w[:, self.nope:])  # (B, H, T, v)


class MLADecoderLayer(nn.Module):
    def __init__(self, spec: MLASpec, mlp: nn.Module, layer_idx: int, eps: float):
        super().__init__()
        self.self_attn = MLAttention(spec, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: MLACache | None = None, shared_topk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, topk = self.self_attn(self.input_layernorm(x), rope, mask, cache, shared_topk)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), topk


class MLADecoder(nn.Module):
    """Token embeddings, N MLA layers, final RMSNorm -> the last hidden state (B, T, C).

    With sparse attention the mask is always built (the indexer needs causality even where SDPA's
    is_causal would do), as transformers does for these models.
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[MLADecoderLayer], eps: float,
                 rope: RotaryEmbedding, pad_token_id: int | None = None, always_mask: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)
        self.rotary_emb = rope
        self.always_mask = always_mask
        # Layers past this count are multi-token-prediction layers (common/mtp.py): they sit in `layers`
        # under their checkpoint index, but the main forward never runs them.
        self.num_main_layers = len(layers)

    def new_cache(self) -> MLACache:
        return MLACache(self.num_main_layers)

    def rope_and_mask(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                      cache: MLACache | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The rotary (cos, sin) and the attention mask (or None: SDPA's is_causal) for x (B, T, C)."""
        position_ids, mask = positions_and_mask(x, cache, attention_mask, position_ids)
        if mask is None and self.always_mask:
            B, T = x.shape[:2]
            past = len(cache) if cache is not None else 0
            q_idx = torch.arange(T, device=x.device)[:, None] + past
            mask = (torch.arange(past + T, device=x.device)[None, :] <= q_idx).expand(B, 1, T, past + T)
        return self.rotary_emb(x, position_ids), mask

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        rope, mask = self.rope_and_mask(x, attention_mask, position_ids, cache)
        topk = None
        for layer in itertools.islice(self.layers, self.num_main_layers):
            x, topk = layer(x, rope, mask, cache, topk)
        return self.norm(x)
