"""DeepSeek-V4's attention: shared-KV multi-query attention with sinks over a sliding window plus compressed entries.

As transformers computes it (eager, the only path it has for V4):
  q_lat = RMSNorm(q_a_proj(x));  q = unweighted RMSNorm per head(q_b_proj(q_lat))           (B, H, T, D)
  kv    = RMSNorm(kv_proj(x))                       one head, read as both key and value     (B, 1, T, D)
  rope on the trailing rope dims of q and kv (adjacent pairs), "main" rope on sliding-only
  layers, "compress" rope on layers with a compressor (common/compressor.py), whose entries
  are appended after the window's keys with their own additive bias;
  p = softmax([q.k * D**-0.5 + mask | sink_h]) without the sink column; out = p @ kv;
  the output's rope dims turned back (-sin: V carried rope too), then the grouped output projection:
  o_a_proj maps each of `o_groups` head groups on its own (`GroupedLinear`), o_b_proj mixes them.
The mask is additive: finfo.min outside the causal sliding window (|q - k| < window), -inf on
compressed entries a query may not see.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kiln.models.common.compressor import SlidingCompressedCache
from kiln.models.common.decoder import segment_ids
from kiln.models.common.norms import Fp32ScaleRMSNorm, UnweightedRMSNorm
from kiln.models.common.rope import apply_rope_tail


def local_part(p: torch.Tensor) -> torch.Tensor:
    """A parameter a tensor-parallel plan split with the heads (a DTensor: kiln.parallel.tp) as this rank's part."""
    return p.to_local() if isinstance(p, DTensor) else p


class GroupedLinear(nn.Module):
    """Block-diagonal linear: input (..., G, in) -> (..., G, out / G), group g through its own rows of `weight`.

    Not an nn.Linear on purpose: LoRA (which wraps Linears) must not treat it as one dense map.
    """

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))  # HF's nn.Linear layout

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, groups, d = x.shape[:-2], x.shape[-2], x.shape[-1]  # groups: this rank's under tensor parallelism
        w = local_part(self.weight).view(groups, -1, d).transpose(1, 2)  # (G, in, out / G)
        y = torch.bmm(x.reshape(-1, groups, d).transpose(0, 1), w).transpose(0, 1)  # (N, G, out / G)
        return y.reshape(*lead, groups, -1)


def _repeat_heads(kv: torch.Tensor, n: int) -> torch.Tensor:
    B, _, S, D = kv.shape
    return kv[:, :, None].expand(B, 1, n, S, D).reshape(B, n, S, D)


def window_mask(batch: int, q_len: int, past: int, kept: int, window: int, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive (B, 1, T, kept + T) mask over the kept past keys and the new ones: 0 inside the causal window.

    Query t sits at index past + t; key j at past - kept + j. Padding (`attention_mask`, over every
    index so far) hides keys; packed rows (positions restarting, no padding mask, no past) keep
    their samples apart, as transformers does.
    """
    q_idx = (torch.arange(q_len, device=device) + past)[None, None, :, None]        # (1, 1, T, 1)
    kv_idx = (torch.arange(kept + q_len, device=device) + past - kept)[None, None, None, :]
    ok = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    if attention_mask is not None:
        pad = attention_mask.to(device=device, dtype=torch.bool)
        if pad.shape[-1] < past + q_len:
            pad = F.pad(pad, (0, past + q_len - pad.shape[-1]), value=True)
        ok = ok & pad[:, None, None, past - kept:past + q_len]
    elif position_ids is not None and past == 0:
        seg = segment_ids(position_ids.expand(batch, -1))
        if seg is not None:
            pos = position_ids.expand(batch, -1)
            b = torch.arange(batch, device=device)[:, None, None, None]
            ok = ok & (seg[b, q_idx] == seg[b, kv_idx]) & (pos[b, kv_idx] <= pos[b, q_idx])
    ok = ok.expand(batch, 1, q_len, kept + q_len)
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, torch.finfo(dtype).min)


class SinkAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, eps: float, layer_idx: int, rope_kind: str, compressor: nn.Module | None = None,
                 dropout: float = 0.0):
        super().__init__()
        self.layer_idx, self.num_heads, self.head_dim, self.o_groups = layer_idx, num_heads, head_dim, o_groups
        self.rope_kind, self.dropout, self.scaling = rope_kind, dropout, head_dim**-0.5
        self.group_width = num_heads * head_dim // o_groups  # one output group's input: its heads side by side
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = Fp32ScaleRMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.q_b_norm = UnweightedRMSNorm(eps)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = Fp32ScaleRMSNorm(head_dim, eps)
        self.o_a_proj = GroupedLinear(num_heads * head_dim // o_groups, o_groups * o_lora_rank, o_groups)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(num_heads))  # per head: a logit for "attend to nothing"
        self.compressor = compressor

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.zeros_(self.sinks)

    def forward(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                position_ids: torch.Tensor, cache: SlidingCompressedCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        cos, sin = ropes[self.rope_kind]
        q_resid = self.q_a_norm(self.q_a_proj(x))  # (B, T, q_lora_rank): the indexer reads it too
        q = self.q_b_norm(self.q_b_proj(q_resid).view(B, T, -1, self.head_dim).transpose(1, 2))  # (B, H, T, D)
        q = apply_rope_tail(q, cos, sin)
        kv = self.kv_norm(self.kv_proj(x)).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, 1, T, D)
        kv = apply_rope_tail(kv, cos, sin)
        if cache is not None:
            kv = cache.update(self.layer_idx, kv)
        if self.compressor is not None:
            states = None if cache is None else cache.states[self.layer_idx]
            entries, bias = self.compressor(x, q_resid, position_ids, states)
            kv = torch.cat([kv, entries], dim=2)
            if kv.shape[2] > mask.shape[-1]:
                mask = torch.cat([mask, bias.to(mask.dtype)], dim=-1) if bias is not None else \
                    F.pad(mask, (0, kv.shape[2] - mask.shape[-1]), value=0.0)
        y = self._attend(q, kv, mask)  # (B, T, H, D)
        y = apply_rope_tail(y.transpose(1, 2), cos, -sin).transpose(1, 2)
        y = self.o_a_proj(y.reshape(B, T, -1, self.group_width)).flatten(2)  # (B, T, G * o_lora_rank)
        return self.o_b_proj(y)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        heads = q.shape[1]  # this rank's under tensor parallelism, with their sinks
        k, v = _repeat_heads(kv, heads), _repeat_heads(kv, heads)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask  # (B, H, T, S)
        sinks = local_part(self.sinks).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values  # not detached: transformers' gradient too
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink column is dropped
        probs = F.dropout(probs, p=self.dropout if self.training else 0.0, training=self.training).to(v.dtype)
        return torch.matmul(probs, v).transpose(1, 2).contiguous()
