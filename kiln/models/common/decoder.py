"""The pre-norm decoder scaffold shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.

  x = embed(ids);  for each layer: x = x + attn(norm(x));  x = x + mlp(norm(x));  out = norm(x)

Attention is grouped-query (num_key_value_heads <= num_heads) with rotary positions and runs
through torch's scaled_dot_product_attention with the same choices transformers' SDPA path makes
(is_causal when nothing is padded, an explicit boolean mask otherwise, enable_gqa vs repeated
k/v heads), so outputs are bit-identical. Families switch parts through `AttentionSpec` and the
MLP they pass in; nothing here knows a family by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.norms import RMSNorm
from kiln.models.common.rope import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class AttentionSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False     # Qwen2: biases on q/k/v only
    o_bias: bool = False
    qk_norm: bool = False      # Qwen3: RMSNorm over head_dim on q and k before rope
    eps: float = 1e-6
    dropout: float = 0.0


class KVCache:
    """Per-layer keys and values (B, KVH, S, D), grown by concatenation as tokens arrive."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past_k, past_v = self.keys[layer], self.values[layer]
        if past_k is not None and past_v is not None:
            k, v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (e.g. after some sequences finished)."""
        self.keys = [None if k is None else k[index] for k in self.keys]
        self.values = [None if v is None else v[index] for v in self.values]


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed rows: a new segment starts wherever the position does not go up by one. None if unpacked."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    seg = (step != 1).cumsum(-1)  # (B, T)
    return None if bool((seg[:, -1] == 0).all()) else seg


def causal_mask(batch: int, q_len: int, past: int, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """(B, 1, Q, K) boolean mask (True = attend), or None when SDPA's is_causal (or no mask) says the same.

    Mirrors transformers' rules: no mask while nothing is padded and queries line up with keys
    (or there is one query); packed rows (positions restarting, no padding mask, no cache) get
    a block-diagonal causal mask so each sample sees only itself.
    """
    kv_len = past + q_len
    pad = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    if pad is not None and pad.shape[-1] < kv_len:
        pad = F.pad(pad, (0, kv_len - pad.shape[-1]))
    seg = None
    if position_ids is not None and attention_mask is None and past == 0:
        seg = segment_ids(position_ids.expand(batch, -1))
    if seg is None:
        if (q_len == 1 or kv_len == q_len) and (pad is None or bool(pad.all())):
            return None
        if past == 0 and (pad is None or (bool(pad[:, :q_len].all()) and not bool(pad[:, q_len:].any()))):
            return None
    q_idx = (torch.arange(q_len, device=device) + past)[None, None, :, None]  # (1, 1, Q, 1)
    kv_idx = torch.arange(kv_len, device=device)[None, None, None, :]        # (1, 1, 1, K)
    b_idx = torch.arange(batch, device=device)[:, None, None, None]           # (B, 1, 1, 1)
    if seg is not None and position_ids is not None:  # seg comes from position_ids: both or neither
        pos = position_ids.expand(batch, -1)
        mask = pos[b_idx, kv_idx] <= pos[b_idx, q_idx]
        mask = mask & (seg[b_idx, q_idx] == seg[b_idx, kv_idx])
    else:
        mask = kv_idx <= q_idx
    if pad is not None:
        mask = mask & pad[b_idx, kv_idx]
    return mask.expand(batch, -1, q_len, kv_len)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)


class Attention(nn.Module):
    # The seam for parallel plans: a callable (q, k, v, scale, dropout_p) -> y that replaces the
    # scaled-dot-product core (context parallelism attends over the whole sequence's keys with it).
    core: Callable[..., torch.Tensor] | None = None

    def __init__(self, spec: AttentionSpec, layer_idx: int):
        super().__init__()
        s = spec
        self.layer_idx, self.head_dim, self.dropout = layer_idx, s.head_dim, s.dropout
        self.groups = s.num_heads // s.num_kv_heads
        self.scaling = s.head_dim**-0.5
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        shape = (B, T, -1, self.head_dim)
        q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)  # (B, T, H, D), (B, T, KVH, D)
        if self.q_norm is not None and self.k_norm is not None:  # qk_norm makes both
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rope(q, k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, KVH, S, D)
        if self.core is not None:  # it masks by itself: `mask` was made for this rank's tokens alone
            y = self.core(q, k, v, self.scaling, self.dropout if self.training else 0.0)  # (B, H, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        extra = {}
        if self.groups > 1:
            # transformers' choice: native GQA when unmasked; a single query folds its head groups
            # into the query axis; otherwise k/v heads are repeated.
            if mask is None and self.head_dim <= 256:
                extra["enable_gqa"] = True
            elif T == 1:
                q = q.reshape(B, -1, self.groups, self.head_dim)  # (B, KVH, groups, D)
            else:
                k, v = _repeat_kv(k, self.groups), _repeat_kv(v, self.groups)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           scale=self.scaling, is_causal=T > 1 and mask is None, **extra)
        y = y.reshape(y.shape[0], -1, T, self.head_dim).transpose(1, 2).contiguous()  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, -1).contiguous())


def positions_and_mask(x: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position ids, attention mask) for the hidden states x (B, T, C) following `len(cache)` cached ones.

    Without position ids, positions count on from the cache; given ones (packed rows restarting at 0)
    also keep the samples apart in the mask, except while decoding from a cache."""
    B, T = x.shape[:2]
    past = len(cache) if cache is not None else 0
    mask = causal_mask(B, T, past, attention_mask, position_ids if cache is None else None, x.device)
    if position_ids is None:
        position_ids = (torch.arange(T, device=x.device) + past).unsqueeze(0)  # (1, T)
    return position_ids, mask


class DecoderLayer(nn.Module):
    def __init__(self, spec: AttentionSpec, mlp: nn.Module, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embeddings, N pre-norm layers, final RMSNorm. Returns the last hidden state (B, T, C)."""

    def __init__(self, vocab_size: int, spec: AttentionSpec, num_layers: int, make_mlp: Callable[[int], nn.Module],
                 rope: RotaryEmbedding, pad_token_id: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, spec.hidden_size, padding_idx=pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(spec, make_mlp(i), i) for i in range(num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.eps)
        self.rotary_emb = rope

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        position_ids, mask = positions_and_mask(x, cache, attention_mask, position_ids)
        rope = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        return self.norm(x)
