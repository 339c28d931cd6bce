"""The engine's forward over the hybrid decoder of Qwen3-Next / Qwen3.5 (text): Gated DeltaNet layers between
gated attention layers, token-packed.

Attention layers keep their keys and values in the paged cache, as the attention runner does (plus the
per-channel sigmoid output gate and rotary on the first dims). A Gated DeltaNet layer keeps, per sequence, a
state slot in the pool: its conv window (the last conv_kernel inputs of [q | k | v], the model's dtype) and its
recurrent state (value heads x key dim x value dim, float32), lent when the sequence starts, copied for each
completion at a fork, returned at finish, cancel or preemption (which recomputes from the first token).

The projections and the MLP run on fixed tiles (`exact.tiled`); the conv, the gated delta rule and the gated
output norm run one token of one sequence at a time, in the order and with the ops of the model's decoding step
(common/hybrid.py conv_step, common/delta_rule.py recurrent_reference), so a token's numbers have fixed shapes
whatever the batch: a prefill chunk, a decode step and the scoring forward give the same bits. The model's own
forward of a prompt runs the chunked form of the rule: the same maths in another order (fp32 rounding).

A later prompt with the same start takes the remembered blocks and the state kept at a block boundary
(kiln.engine.prefix_state: snapshots at every few blocks and at each prompt's last full block, by the blocks'
content keys, images included), and prefills only the rest; a preempted request's completions each recompute their
sequence from the deepest kept boundary (kiln.engine.scheduler).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kiln.engine.cache import BlockPool
from kiln.engine.exact import attend, lanewise, tiled
from kiln.engine.runner import register
from kiln.engine.state import StateRunner, States
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.common.delta_rule import l2norm
from kiln.models.common.hybrid import (
    GatedAttention,
    GatedDeltaNet,
    HybridDecoder,
    HybridDecoderLayer,
)
from kiln.models.common.rope import apply_partial_rope


@register
class HybridRunner(StateRunner):
    """Runs a ForCausalLM over `HybridDecoder` (Gated DeltaNet + gated attention layers)."""

    families = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5 and qwen3_5_moe (text prompts)")
    keeps_prefix_state = True  # its state runs through StateRunner._recur, which keeps it at prefix boundaries

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        backbone = getattr(model, "model", None)
        return (isinstance(model, ForCausalLM) and type(backbone) is HybridDecoder
                and all(type(layer) is HybridDecoderLayer
                        and (isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet)
                             or type(getattr(layer, "self_attn", None)) is GatedAttention)
                        for layer in backbone.layers))

    @classmethod
    def refuse(cls, model: nn.Module, name: str) -> str | None:
        return None

    def _setup(self) -> None:
        layers = self.backbone.layers
        self.delta = [hasattr(layer, "linear_attn") for layer in layers]
        attn = next((layer.self_attn for layer in layers if hasattr(layer, "self_attn")), None)
        if attn is not None:
            self.head_dim, self.groups, self.scale = attn.head_dim, attn.groups, attn.scaling
            self.kv_heads = attn.k_proj.out_features // attn.head_dim

    def state_shapes(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        if not self.delta[i]:
            return []
        m = self.backbone.layers[i].linear_attn
        conv = m.conv1d.weight
        return [((conv.shape[0], conv.shape[-1]), conv.dtype), ((m.num_v_heads, m.head_k_dim, m.head_v_dim),
                                                                  torch.float32)]

    def new_pool(self, num_blocks: int, block_size: int, seqs: int = 1) -> BlockPool:
        # nothing per token in a DeltaNet layer: its state is per sequence
        slots = [((0,), (0,)) if self.delta[i] else ((self.kv_heads, self.head_dim),) * 2
                 for i in range(self.num_layers)]
        return self.state_pool(num_blocks, block_size, seqs, slots)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, kv, states: States | None = None) -> torch.Tensor:
        """`states` None: the call is one sequence from its first token (fresh state)."""
        x = self.backbone.embed_tokens(ids)  # (N, C)
        cos, sin = self.cos[positions], self.sin[positions]
        states = states or self._dense_extras(ids.shape[0])[0]
        for i in range(self.num_layers):
            x = self._delta_layer(i, x, states) if self.delta[i] else self._attn_layer(i, x, cos, sin, kv)
        return x

    # ---- the layers -----------------------------------------------------------------------------
    def _post(self, i: int, x: torch.Tensor, y: torch.Tensor, out: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        layer, mlp = self.backbone.layers[i], self.mlps[i]

        def post(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
            xt = xt + out(yt)
            return xt + mlp(layer.post_attention_layernorm(xt))

        return tiled(post, x, y)

    def _attn_layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        layer = self.backbone.layers[i]
        a, D, KVH, G = layer.self_attn, self.head_dim, self.kv_heads, self.groups
        H = KVH * G

        def qkv(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            h = layer.input_layernorm(t)
            q, gate = a.q_proj(h).view(h.shape[0], H, 2 * D).chunk(2, -1)
            q, k = a.q_norm(q), a.k_norm(a.k_proj(h).view(h.shape[0], KVH, D))
            q, k = apply_partial_rope(q, k, c, s)  # c (T, rotary): over heads
            return torch.cat([q.flatten(1), k.flatten(1), a.v_proj(h), gate.flatten(1)], 1)

        out = tiled(qkv, x, cos, sin)
        q = out[:, :H * D].view(-1, KVH, G, D)
        k = out[:, H * D:(H + KVH) * D].view(-1, KVH, D)
        v = out[:, (H + KVH) * D:(H + 2 * KVH) * D].view(-1, KVH, D)
        y = q.new_empty((x.shape[0], H * D))
        for s, e, pos, kb, vb in kv(i, k, v):
            y[s:e] = attend(q[s:e], kb, vb, pos, self.scale).flatten(1)
        y = torch.cat([y, out[:, (H + 2 * KVH) * D:]], 1)  # [attention | gate]
        return self._post(i, x, y, lambda t: a.o_proj(t[:, :H * D] * lanewise(torch.sigmoid, t[:, H * D:])))

    def _delta_layer(self, i: int, x: torch.Tensor, states: States) -> torch.Tensor:
        layer = self.backbone.layers[i]
        m = layer.linear_attn

        def project(t: torch.Tensor) -> torch.Tensor:
            qkv, z, b, a = m.project(layer.input_layernorm(t)[None])  # the model's own projections, (1, T, .)
            return torch.cat([qkv[0], z[0].flatten(1), b[0], a[0]], 1)

        p = tiled(project, x)
        y = self._recur(i, p, m.value_dim, states, lambda st, row: self._delta_token(m, st, row))
        return self._post(i, x, y, m.out_proj)

    @staticmethod
    def _delta_token(m: GatedDeltaNet, state: list[torch.Tensor], row: torch.Tensor
                     ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One token: [conv window (Cc, K), state (H, Dk, Dv)] and its projected row -> the new ones and the
        output (H * Dv,), as the model's decoding step computes them (conv_step, recurrent_reference, the gated
        norm)."""
        conv, rec = state
        Cc, H, Dk, Dv = conv.shape[0], m.num_v_heads, m.head_k_dim, m.head_v_dim
        qkv, z, b, a = row.split([Cc, H * Dv, H, H])
        window = torch.cat([conv[:, 1:], qkv[:, None].to(conv.dtype)], 1)  # the last K inputs
        mixed = m.act(F.conv1d(window[None], m.conv1d.weight, m.conv1d.bias, groups=Cc))[0, :, 0].to(row.dtype)
        q, k, v = mixed.split([m.key_dim, m.key_dim, m.value_dim])
        q, k = q.view(-1, Dk), k.view(-1, Dk)
        if q.shape[0] != H:  # each q/k head serves H / Hk consecutive value heads
            q, k = q.repeat_interleave(H // q.shape[0], 0), k.repeat_interleave(H // k.shape[0], 0)
        q, k = l2norm(q.float()), l2norm(k.float())
        q = q / (Dk**0.5)
        beta = b.float().sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        rec = rec * g.exp()[:, None, None]
        memory = (rec * k[:, :, None]).sum(dim=-2)  # what the state already says for k
        delta = (v.view(H, Dv).float() - memory) * beta[:, None]
        rec = rec + k[:, :, None] * delta[:, None, :]
        o = (rec * q[:, :, None]).sum(dim=-2).to(row.dtype)  # (H, Dv)
        o = m.norm(o, z.view(H, Dv))
        return [window, rec], o.flatten()
