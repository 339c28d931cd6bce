"""The last decoder layer run only where a score is read: a reward model's (or any sequence head's) tail.

A sequence-classification head reads one hidden state per sequence, at its last token. Every layer but the last
is needed at every position (the last layer's keys and values come from all of them), but the last layer's query,
attention output, MLP and the final norm matter only at the read positions. `scored_hidden` runs the backbone to
the last layer, then that layer's keys and values over every position and the rest of it at the N read positions
alone: for a batch of short sequences that drops most of one layer's products, forward and backward. Each read
position attends to exactly the keys the full forward lets it see (the same mask row), so the result is the full
forward's hidden state there within fp32 rounding (the products have other shapes, so other summation orders).

It applies to kiln's common pre-norm decoder (kiln.models.common.decoder) with its own attention (no context
parallel core), a gated MLP (an MoE layer's routing statistics would see only the read tokens) and no attention
dropout while training; `applies` says so, and the caller falls back to the full forward otherwise. Forward hooks
on the last layer or its attention do not run (its submodules' hooks do).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.decoder import Attention, Decoder, DecoderLayer, positions_and_mask
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.rope import rotate_half

__all__ = ["applies", "scored_hidden"]


def applies(decoder: nn.Module, training: bool) -> bool:
    """Whether `scored_hidden` computes what `decoder`'s own forward computes at the read positions."""
    if type(decoder) is not Decoder or len(decoder.layers) == 0:
        return False
    last = decoder.layers[-1]
    if type(last) is not DecoderLayer or type(last.self_attn) is not Attention or type(last.mlp) is not GatedMLP:
        return False
    attn = last.self_attn
    return attn.core is None and not (training and attn.dropout > 0)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x (.., H, S, D) with cos/sin (.., S, D): apply_rope's product for one tensor."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def scored_hidden(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(N, C) the final hidden state (after the final norm) at (rows[i], cols[i]) of input_ids (B, T): what
    `decoder(input_ids, attention_mask, position_ids)[rows, cols]` is, the last layer run only there."""
    assert isinstance(decoder, Decoder), "scored_hidden runs only where applies() said so"
    x = decoder.embed_tokens(input_ids)  # (B, T, C)
    position_ids, mask = positions_and_mask(x, None, attention_mask, position_ids)
    cos, sin = decoder.rotary_emb(x, position_ids)  # (1 or B, T, D)
    for layer in decoder.layers[:-1]:
        x = layer(x, (cos, sin), mask)
    last = cast(DecoderLayer, decoder.layers[-1])
    attn = last.self_attn
    B, T, _ = x.shape
    N, D = rows.shape[0], attn.head_dim
    h = last.input_layernorm(x)
    q = attn.q_proj(h[rows, cols]).view(N, 1, -1, D)  # (N, 1, H, D): one query per read position
    k, v = attn.k_proj(h).view(B, T, -1, D), attn.v_proj(h).view(B, T, -1, D)  # every position's
    if attn.q_norm is not None and attn.k_norm is not None:  # both or neither (AttentionSpec.qk_norm)
        q, k = attn.q_norm(q), attn.k_norm(k)
    at = rows if cos.shape[0] > 1 else torch.zeros_like(rows)
    q = _turn(q.transpose(1, 2), cos[at, cols][:, None], sin[at, cols][:, None])  # (N, H, 1, D)
    k = _turn(k.transpose(1, 2), cos, sin)[rows]  # (N, KVH, T, D): each query's own row of keys
    v = v.transpose(1, 2)[rows]
    if attn.groups > 1:  # kv head j serves query heads j*groups ... (j+1)*groups-1, as the full forward repeats them
        k, v = k.repeat_interleave(attn.groups, dim=1), v.repeat_interleave(attn.groups, dim=1)
    # (N, T) the full forward's own mask row for each query; without a mask it ran causal: position c sees 0..c
    see = torch.arange(T, device=x.device)[None, :] <= cols[:, None] if mask is None else mask[rows, 0, cols]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=see[:, None, None, :], scale=attn.scaling)  # (N, H, 1, D)
    r = x[rows, cols] + attn.o_proj(y.reshape(N, -1))  # (N, C)
    r = r + last.mlp(last.post_attention_layernorm(r))
    return decoder.norm(r)
