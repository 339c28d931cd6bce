"""The hybrid decoder of Qwen3-Next / Qwen3.5: Gated DeltaNet layers between gated full-attention layers.

  x = embed(ids);  each layer: x = x + mixer(norm(x));  x = x + mlp(norm(x));  out = norm(x)
  mixer = `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention), per `layer_types`.

GatedAttention: grouped-query SDPA as in `decoder.py`, plus a sigmoid output gate per channel
(q_proj emits [query | gate] per head), zero-centred q/k norms and rotary on the first dims only.
GatedDeltaNet: projections -> short causal depthwise conv (silu) over [q | k | v] -> gated delta
rule (`delta_rule.py`) -> RMSNorm(out) * silu(z) per head -> out_proj. Padded positions are zeroed
before the projections. Packed rows (positions restarting, no padding mask) restart the conv window
and the recurrent state at each sample. Norm classes, projections and the MLP come from the family.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common import delta_rule
from kiln.models.common.activations import activation
from kiln.models.common.decoder import KVCache, causal_mask, segment_ids
from kiln.models.common.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from kiln.models.common.rope import apply_partial_rope
from kiln.models.common.ssm import causal_conv1d


class HybridCache(KVCache):
    """Keys/values for attention layers; the conv window (B, C, K) and the state (B, H, Dk, Dv) for DeltaNet ones."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers
        self.tokens = 0  # counted by the decoder: a DeltaNet-only stack has no keys to measure

    def __len__(self) -> int:
        return self.tokens

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self.conv_states = [None if s is None else s[index] for s in self.conv_states]
        self.recurrent_states = [None if s is None else s[index] for s in self.recurrent_states]


# ---- gated full attention ---------------------------------------------------------------------
class GatedAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, layer_idx: int, eps: float = 1e-6,
                 bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.layer_idx, self.head_dim, self.dropout = layer_idx, head_dim, dropout
        self.groups, self.scaling = heads // kv_heads, head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim * 2, bias=bias)  # per head: [query | gate]
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        D = self.head_dim
        q, gate = torch.chunk(self.q_proj(x).view(B, T, -1, 2 * D), 2, dim=-1)  # (B, T, H, D) each
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q.view(B, T, -1, D)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q, k = apply_partial_rope(q, k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, KVH, S, D)
        extra = {}
        if self.groups > 1:  # transformers' SDPA choices, as in decoder.Attention
            if mask is None and D <= 256:
                extra["enable_gqa"] = True
            elif T == 1:
                q = q.reshape(B, -1, self.groups, D)
            else:
                k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           scale=self.scaling, is_causal=T > 1 and mask is None, **extra)
        y = y.reshape(B, -1, T, D).transpose(1, 2).contiguous()  # (B, T, H, D)
        y = y.reshape(B, T, -1).contiguous() * torch.sigmoid(gate)  # Qwen3-Next: output gate
        return self.o_proj(y)


# ---- Gated DeltaNet ---------------------------------------------------------------------------
def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Decode step: x (B, C, T) after the window `state` (B, C, K), which is updated in place."""
    T, K = x.shape[-1], state.shape[-1]
    full = torch.cat([state, x], dim=-1).to(weight.dtype)
    state.copy_(full[:, :, -K:])
    out = F.conv1d(full, weight, bias, padding=0, groups=x.shape[1])[:, :, -T:]
    return act(out).to(x.dtype)


def _window_masks(resets: torch.Tensor | None, K: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Per look-back s (0..K-1): (B, T, 1) 1 where the tap s steps back stays inside the packed sample, or None."""
    if resets is None:
        return [None] * K
    idx = torch.arange(resets.shape[-1], device=resets.device)
    seen = (idx - torch.where(resets, idx, 0).cummax(-1).values)[..., None]  # (B, T, 1) steps into the sample
    return [None] + [(seen >= s).to(dtype) for s in range(1, K)]


def tap_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             act: Callable[[torch.Tensor], torch.Tensor], resets: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv over time-major x (B, T, C) as K shifted multiply-adds (fast path, packed rows).

    No transposes, and a backward of K elementwise products (torch's CPU depthwise conv1d wants (B, C, T)
    and its backward is slow). With `resets` (B, T) no window reaches back past a packed sample's start.
    With SiLU (the Gated DeltaNet's) conv and activation are one autograd node that writes in place.
    """
    K = weight.shape[-1]
    w = weight[:, 0, :].t()  # (K, C); column K-1-s is the tap s steps back
    keep = _window_masks(resets, K, weight.dtype)
    if isinstance(act, nn.SiLU):
        return _SiluTapConv.apply(x.to(weight.dtype), w, bias, *keep[1:]).to(x.dtype)
    T = x.shape[1]
    xp = F.pad(x.to(weight.dtype), (0, 0, K - 1, 0))  # (B, T + K - 1, C)

    def tap(j: int) -> torch.Tensor:  # tap j looks K-1-j steps back
        m = keep[K - 1 - j]
        return xp[:, j:j + T] if m is None else xp[:, j:j + T] * m

    out = tap(0) * w[0]
    for j in range(1, K):
        out = torch.addcmul(out, tap(j), w[j])
    if bias is not None:
        out = out + bias
    return act(out).to(x.dtype)


class _SiluTapConv(torch.autograd.Function):
    """silu(sum_s w[K-1-s] * x[t - s] + bias) over (B, T, C), each tap added in place into one buffer; the
    backward recomputes nothing but silu's derivative and reuses one scratch buffer for the weight sums."""

    @staticmethod
    def forward(ctx, x, w, bias, *keep):
        T, K = x.shape[1], w.shape[0]
        pre = torch.zeros_like(x)
        for s in range(min(K, T) - 1, -1, -1):  # the farthest tap first, as the generic path sums
            src = x[:, :T - s] if s == 0 or keep[s - 1] is None else x[:, :T - s] * keep[s - 1][:, s:]
            pre[:, s:].addcmul_(src, w[K - 1 - s])
        if bias is not None:
            pre += bias
        ctx.save_for_backward(x, w, pre, *[m for m in keep if m is not None])
        ctx.has_bias, ctx.masked = bias is not None, keep[0] is not None if keep else False
        return F.silu(pre)

    @staticmethod
    def backward(ctx, dy):
        x, w, pre, *keep = ctx.saved_tensors
        T, K = x.shape[1], w.shape[0]
        d_pre = torch.ops.aten.silu_backward(dy, pre)
        d_x = d_pre * w[K - 1]
        d_w = torch.empty_like(w)
        scratch = torch.mul(d_pre, x)
        d_w[K - 1] = scratch.sum((0, 1))
        for s in range(1, K):
            if s >= T:
                d_w[K - 1 - s] = 0
                continue
            grad = d_pre[:, s:] if not ctx.masked else d_pre[:, s:] * keep[s - 1][:, s:]
            d_x[:, :T - s].addcmul_(grad, w[K - 1 - s])
            part = scratch[:, :T - s]
            d_w[K - 1 - s] = torch.mul(grad, x[:, :T - s], out=part).sum((0, 1))
        d_bias = d_pre.sum((0, 1)) if ctx.has_bias else None
        return (d_x, d_w, d_bias) + (None,) * (K - 1)


def _samples(resets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sample of packed rows."""
    out = []
    for b, row in enumerate(resets.tolist()):
        starts = [0] + [t for t, r in enumerate(row) if r and t > 0] + [len(row)]
        out += [(b, s, e) for s, e in itertools.pairwise(starts)]
    return out


class GatedDeltaNet(nn.Module):
    """Projections are Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); Qwen3-Next overrides `project`.

    `fast_delta_rule` picks the chunked rule with the analytic backward (training) over the
    bit-exact reference; `delta_rule.set_fast(model)` flips it for a whole model.
    """

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, layer_idx: int, act: str = "silu", eps: float = 1e-6):
        super().__init__()
        self.layer_idx, self.fast_delta_rule = layer_idx, False
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, padding=conv_kernel - 1, bias=False)
        self.act = activation(act)
        self.make_projections(hidden)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, T, C) -> [q | k | v] (B, T, 2Kd + Vd), z (B, T, H, Dv), b and a (B, T, H)."""
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, T, -1, self.head_v_dim)
        return qkv, z, self.in_proj_b(x), self.in_proj_a(x)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())  # decay rates spread over heads
        nn.init.normal_(self.conv1d.weight, 0.0, std)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: HybridCache | None = None,
                resets: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:  # padding contributes nothing to the conv window or the state
            x = (x * mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        i = self.layer_idx
        conv_state = cache.conv_states[i] if cache is not None else None
        state = cache.recurrent_states[i] if cache is not None else None
        qkv, z, b, a = self.project(x)  # qkv (B, T, Cc)
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if cache is None and (self.fast_delta_rule or resets is not None):
            qkv = tap_conv(qkv, weight, bias, self.act, resets)
        else:  # transformers' layout and ops, bit for bit
            qkv = qkv.transpose(1, 2)  # (B, Cc, T)
            if conv_state is not None and T == 1:
                qkv = conv_step(qkv, conv_state, weight, bias, self.act)
            else:
                if cache is not None:  # keep the last K inputs (zero-padded on the left) for the next step
                    K = weight.shape[-1]
                    qkv = qkv if conv_state is None else torch.cat([conv_state, qkv], dim=-1)
                    if conv_state is None and qkv.shape[-1] < K:
                        qkv = F.pad(qkv, (K - qkv.shape[-1], 0))
                    cache.conv_states[i] = qkv[..., -K:].clone()
                qkv = causal_conv1d(qkv, weight, bias, self.act)
                if cache is not None:
                    qkv = qkv[:, :, -T:]
            qkv = qkv.transpose(1, 2)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, -1, self.head_k_dim)
        k = k.reshape(B, T, -1, self.head_k_dim)
        v = v.reshape(B, T, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, H) log decay <= 0
        keep = cache is not None
        if state is not None and T == 1:
            out, state = delta_rule.recurrent_reference(q, k, v, g, beta, state, keep)
        elif self.fast_delta_rule:
            out, state = delta_rule.chunk_fast(q, k, v, g, beta, state, keep, resets)
        elif resets is not None:  # the exact rule knows no restarts: run each packed sample alone
            out = torch.cat([delta_rule.chunk_reference(q[r:r + 1, s:e], k[r:r + 1, s:e], v[r:r + 1, s:e],
                                                        g[r:r + 1, s:e], beta[r:r + 1, s:e])[0]
                             for r, s, e in _samples(resets)], dim=1).view(B, T, -1, self.head_v_dim)
        else:
            out, state = delta_rule.chunk_reference(q, k, v, g, beta, state, keep)
        if cache is not None:
            cache.recurrent_states[i] = state
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(B, T, -1))


# ---- layers and stack ---------------------------------------------------------------------------
class HybridDecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope, mask, linear_mask, resets, cache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, linear_mask, cache, resets)
        else:
            h = self.self_attn(h, rope, mask, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoder(nn.Module):
    """Token embeddings, the hybrid layers, final zero-centred RMSNorm -> last hidden state (B, T, C)."""

    def __init__(self, vocab_size: int, hidden: int, layers: list[HybridDecoderLayer], rope: nn.Module, eps: float,
                 pad_token_id: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden, padding_idx=pad_token_id)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(hidden, eps)
        self.rotary_emb = rope

    def new_cache(self) -> HybridCache:
        return HybridCache(len(self.layers))

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: HybridCache | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        B, T = x.shape[:2]
        past = len(cache) if cache is not None else 0
        text_positions, rope_positions = position_ids, position_ids
        if position_ids is not None and position_ids.dim() == 3:  # multimodal (3 or 4, B, T); row 0 of 4 is text
            text_positions = position_ids[0] if position_ids.shape[0] == 4 else None
            rope_positions = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
        if rope_positions is None:
            rope_positions = (torch.arange(T, device=x.device) + past).unsqueeze(0)  # (1, T)
        packed = text_positions is not None and attention_mask is None and cache is None
        mask = causal_mask(B, T, past, attention_mask, text_positions if cache is None else None, x.device)
        linear_mask = None
        if attention_mask is not None and T > 1 and not bool(attention_mask.all()):
            linear_mask = attention_mask[:, -T:]
        resets = None
        if packed and text_positions is not None:  # packed says text_positions is set
            seg = segment_ids(text_positions.expand(B, -1))
            resets = None if seg is None else torch.diff(seg, dim=-1, prepend=seg[:, :1]) != 0  # (B, T)
        rope = self.rotary_emb(x, rope_positions)
        for layer in self.layers:
            x = layer(x, rope, mask, linear_mask, resets, cache)
        if cache is not None:
            cache.tokens += T
        return self.norm(x)
