"""DeepSeek-V4's KV compressors (HCA and CSA), the lightning indexer over CSA's entries, and their cache.

A compressor pools every `rate` consecutive tokens into one extra key (= value) that the attention
sees beside its sliding window, as transformers computes it:
  kv, gate = kv_proj(x), gate_proj(x)                              per token
  entry_w  = RMSNorm(sum_j softmax_j(gate_j + position_bias_j) * kv_j)   over window w, softmax in float32
  rope on the entry's trailing rope dims, at position w * rate
- HCA ("heavily compressed"): non-overlapping windows; query t sees entry w once w * rate <= t + 1 - rate.
- CSA ("compressed sparse"): kv/gate carry two series (Ca | Cb); entry w pools Cb of window w with Ca
  of window w - 1 (2 * rate slots, stride rate). Its `Indexer` pools the same way at index_head_dim,
  scores sum_h w_h * relu(q_h . k) per query and keeps the top `index_topk` causal entries; the
  attention sees only those.
Without a cache the compressors pool the complete windows of the input and drop the rest. With one
(`CompressorState` per layer and series) the tokens of an unfinished window wait in a buffer, the
emitted entries accumulate, and CSA keeps the last window's Ca for the next call.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.norms import Fp32ScaleRMSNorm
from kiln.models.common.rope import PairRotaryEmbedding, apply_rope_tail


class CompressorState:
    """One compressor's decoding state: buffered tokens, emitted entries (B, n, D), CSA's carried Ca slice."""

    def __init__(self) -> None:
        self.buffer_kv: torch.Tensor | None = None
        self.buffer_gate: torch.Tensor | None = None
        self.entries: torch.Tensor | None = None
        self.count = 0  # entries emitted so far: the next window starts at token count * rate
        self.overlap_kv: torch.Tensor | None = None
        self.overlap_gate: torch.Tensor | None = None

    def windows(self, kv: torch.Tensor, gate: torch.Tensor, rate: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The buffered + new tokens that fill whole windows, and the first window's start; keep the rest."""
        first = self.count * rate
        if self.buffer_kv is not None and self.buffer_gate is not None and self.buffer_kv.shape[1]:
            kv, gate = torch.cat([self.buffer_kv, kv], dim=1), torch.cat([self.buffer_gate, gate], dim=1)
        usable = (kv.shape[1] // rate) * rate
        self.buffer_kv, self.buffer_gate = kv[:, usable:], gate[:, usable:]
        return kv[:, :usable], gate[:, :usable], first

    def carry(self, kv: torch.Tensor, gate: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CSA: hand back the Ca slice saved last call (None at first) and keep this call's last one."""
        prior = None if self.overlap_kv is None or self.overlap_gate is None else (self.overlap_kv, self.overlap_gate)
        self.overlap_kv, self.overlap_gate = kv[:, -1, :, :dim].clone(), gate[:, -1, :, :dim].clone()
        return prior

    def append(self, entries: torch.Tensor) -> torch.Tensor:
        if self.entries is None:
            self.entries = entries
        elif entries.shape[1] > 0:
            self.entries = torch.cat([self.entries, entries], dim=1)
        self.count += entries.shape[1]
        return self.entries

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[index])


class WindowPool(nn.Module):
    """kv_proj, gate_proj, position_bias, kv_norm: tokens (B, S, C) -> pooled, rotated entries (B, n, D)."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float,
                 rope: dict, max_positions: int, rope_dim: int):
        super().__init__()
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        width = 2 * head_dim if overlap else head_dim  # CSA: the two series Ca | Cb side by side
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = Fp32ScaleRMSNorm(head_dim, eps)
        self.rotary_emb = PairRotaryEmbedding(rope_dim, rope, max_positions)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.zeros_(self.position_bias)

    def pool(self, x: torch.Tensor, state: CompressorState | None) -> torch.Tensor:
        """Not `forward`: each subclass's forward takes more (queries, positions) and returns its own shapes."""
        B = x.shape[0]
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if state is None:
            usable = (kv.shape[1] // self.rate) * self.rate
            kv, gate, first = kv[:, :usable], gate[:, :usable], 0
        else:
            kv, gate, first = state.windows(kv, gate, self.rate)
        if kv.shape[1] == 0:
            entries = kv.new_zeros((B, 0, self.head_dim))
        else:
            n, r, d = kv.shape[1] // self.rate, self.rate, self.head_dim
            kv = kv.view(B, n, r, -1)
            gate = gate.view(B, n, r, -1) + self.position_bias
            if self.overlap:  # slots [0, r): Ca of the previous window; [r, 2r): Cb of this one
                pooled_kv = kv.new_zeros((B, n, 2 * r, d))
                pooled_gate = gate.new_full((B, n, 2 * r, d), float("-inf"))  # an empty slot weighs 0
                pooled_kv[:, :, r:] = kv[..., d:]
                pooled_gate[:, :, r:] = gate[..., d:]
                if n > 1:
                    pooled_kv[:, 1:, :r] = kv[:, :-1, :, :d]
                    pooled_gate[:, 1:, :r] = gate[:, :-1, :, :d]
                if state is not None:
                    prior = state.carry(kv, gate, d)
                    if prior is not None:
                        prior_kv, prior_gate = prior
                        pooled_kv[:, 0, :r] = prior_kv.to(pooled_kv.dtype)
                        pooled_gate[:, 0, :r] = prior_gate.to(pooled_gate.dtype)
                kv, gate = pooled_kv, pooled_gate
            entries = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
            positions = (torch.arange(n, device=x.device) * r + first).unsqueeze(0).expand(B, -1)
            cos, sin = self.rotary_emb(entries, positions)
            entries = apply_rope_tail(entries.unsqueeze(1), cos, sin).squeeze(1)  # (B, n, D)
        return entries if state is None else state.append(entries)


def causal_threshold(position_ids: torch.Tensor, rate: int) -> torch.Tensor:
    """(B, S): how many entries each query may see (entry w covers tokens up to (w + 1) * rate - 1)."""
    return (position_ids + 1) // rate


class HCACompressor(WindowPool):
    def __init__(self, hidden_size: int, head_dim: int, rate: int, eps: float, rope: dict, max_positions: int,
                 rope_dim: int):
        super().__init__(hidden_size, head_dim, rate, False, eps, rope, max_positions, rope_dim)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, position_ids: torch.Tensor,
                states: dict[str, CompressorState] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> entries (B, 1, n, D), additive bias (B, 1, S, n) hiding entries not yet complete (None: all visible)."""
        B = x.shape[0]
        entries = self.pool(x, None if states is None else states["compressor"]).unsqueeze(1)
        n, S = entries.shape[2], position_ids.shape[1]
        if S == 1 or n == 0:
            return entries, None
        future = torch.arange(n, device=x.device).view(1, 1, 1, -1) >= \
            causal_threshold(position_ids, self.rate).unsqueeze(1).unsqueeze(-1)
        return entries, entries.new_zeros((B, 1, S, n)).masked_fill(future, float("-inf"))


class Indexer(WindowPool):
    """CSA's lightning indexer: its own pooled keys at index_head_dim, queries from the query latent."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, rate: int,
                 eps: float, rope: dict, max_positions: int, rope_dim: int):
        super().__init__(hidden_size, head_dim, rate, True, eps, rope, max_positions, rope_dim)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, heads, head_dim)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, position_ids: torch.Tensor,
                state: CompressorState | None) -> torch.Tensor:
        """-> (B, S, k) entry ids per query, -1 where fewer than k entries are complete."""
        B, S, _ = x.shape
        keys = self.pool(x, state)  # (B, n, d)
        cos, sin = self.rotary_emb(x, position_ids)
        q = self.q_b_proj(q_resid).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, d)
        q = apply_rope_tail(q, cos, sin).transpose(1, 2)  # (B, S, H, d)
        scores = self.scorer(q, keys, x)  # (B, S, n)
        n = keys.shape[1]
        k = min(self.topk, n)
        if n == 0:
            return scores.topk(k, dim=-1).indices
        limit = causal_threshold(position_ids, self.rate).unsqueeze(-1)  # (B, S, 1)
        scores = scores.masked_fill(torch.arange(n, device=x.device).view(1, 1, -1) >= limit, float("-inf"))
        picked = scores.topk(k, dim=-1).indices
        return torch.where(picked >= limit, torch.full_like(picked, -1), picked)


class IndexerScorer(nn.Module):
    """sum_h w_{t,h} * relu(q_{t,h} . k_s) * d**-0.5, with w = weights_proj(x) * H**-0.5; float32."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int):
        super().__init__()
        self.softmax_scale, self.weights_scaling = head_dim**-0.5, heads**-0.5
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # (B, S, H, n)
        scores = F.relu(scores) * self.softmax_scale
        weights = self.weights_proj(x).float() * self.weights_scaling  # (B, S, H)
        return (scores * weights.unsqueeze(-1)).sum(dim=2)


class CSACompressor(WindowPool):
    def __init__(self, hidden_size: int, head_dim: int, rate: int, eps: float, rope: dict, max_positions: int,
                 rope_dim: int, q_lora_rank: int, index_heads: int, index_head_dim: int, index_topk: int):
        super().__init__(hidden_size, head_dim, rate, True, eps, rope, max_positions, rope_dim)
        self.indexer = Indexer(hidden_size, q_lora_rank, index_heads, index_head_dim, index_topk, rate, eps, rope,
                               max_positions, rope_dim)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, position_ids: torch.Tensor,
                states: dict[str, CompressorState] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> entries (B, 1, n, D), additive bias (B, 1, S, n): 0 on the entries the indexer picked, else -inf."""
        B, S, _ = x.shape
        entries = self.pool(x, None if states is None else states["compressor"]).unsqueeze(1)
        picked = self.indexer(x, q_resid, position_ids, None if states is None else states["indexer"])
        n = entries.shape[2]
        # -1 (no entry) goes to a spare column that is cut off after the scatter
        safe = torch.where(picked >= 0, picked, torch.full_like(picked, n))
        bias = entries.new_full((B, 1, S, n + 1), float("-inf"))
        bias.scatter_(-1, safe.unsqueeze(1), 0.0)
        return entries, bias[..., :n]


class SlidingCompressedCache:
    """DeepSeek-V4's decoding cache: per layer the last window - 1 keys (K = V), and its compressors' states."""

    def __init__(self, num_layers: int, window: int, series: list[tuple[str, ...]]):
        self.window = window
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.states: list[dict[str, CompressorState] | None] = [
            {name: CompressorState() for name in names} if names else None for names in series]
        self.seen = 0  # tokens fed so far (every layer sees the same ones)

    def __len__(self) -> int:
        return self.seen

    def kept(self) -> int:
        """How many past keys each layer holds (the start of the window the next tokens attend over)."""
        return min(self.seen, self.window - 1)

    def update(self, layer: int, kv: torch.Tensor) -> torch.Tensor:
        """Past kept keys + the new ones (B, 1, kept + T, D); keeps the last window - 1 of them."""
        past = self.keys[layer]
        full = kv if past is None else torch.cat([past, kv], dim=-2)
        self.keys[layer] = full[:, :, -self.window + 1:, :]
        return full

    def advance(self, tokens: int) -> None:
        self.seen += tokens

    def reorder(self, index: torch.Tensor) -> None:
        self.keys = [None if k is None else k[index] for k in self.keys]
        for states in self.states:
            for s in (states or {}).values():
                s.reorder(index)
