"""The engine's forward over multi-head latent attention decoders (DeepSeek-V3), token-packed.

The paged cache holds per token and layer what the model's own cache holds (common/mla.py): the normalised KV
latent (kv_lora_rank numbers) as the pool's key slot and the rotated rope key shared by every head
(qk_rope_head_dim numbers) as its value slot, never per-head keys and values. Attention always runs in the
absorbed form, in a prefill chunk, a decode step and the scoring forward alike (one kernel, fixed shapes):
each head's no-rope query goes into latent space through its slice of kv_b_proj (q_lat = q_nope W_k), so
every query head reads [latent | k_rope] as one shared key head (`exact.attend` with one kv head and H query
heads) and the latent itself as the value; a head's output comes back through its value slice
(o = (p . latent) W_v^T). The q . k products are the model's (q_nope . W_k latent + q_rope . k_rope), in
another summation order than its forward, which expands the latent into per-head keys and values: the
engine's log-probs equal kiln.engine.token_logps bit for bit, and the model's forward to fp32 rounding.

Everything else is the attention runner's (kiln.engine.runner): the tiles, the pieces, the block tables.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.engine.cache import BlockPool
from kiln.engine.exact import attend, tiled
from kiln.engine.runner import DecoderRunner, register
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.common.mla import MLADecoder, MLADecoderLayer, MLAttention


def main_layers(backbone: nn.Module) -> list[nn.Module]:
    return list(backbone.layers)[:backbone.num_main_layers]


@register
class MLARunner(DecoderRunner):
    """Runs a ForCausalLM over `MLADecoder` with dense latent attention (the sparse kind: kiln.engine.dsa)."""

    families = ("deepseek_v3",)

    @staticmethod
    def latent(model: nn.Module) -> bool:
        """Whether `model` is a ForCausalLM over latent-attention layers (sparse or not)."""
        backbone = getattr(model, "model", None)
        return (isinstance(model, ForCausalLM) and type(backbone) is MLADecoder
                and all(type(layer) is MLADecoderLayer and type(layer.self_attn) is MLAttention
                        for layer in main_layers(backbone)))

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        return cls.latent(model) and not any(layer.self_attn.sparse for layer in main_layers(model.model))

    @classmethod
    def refuse(cls, model: nn.Module, name: str) -> str | None:
        layers = main_layers(model.model)
        if any(layer.self_attn.context is not None for layer in layers):
            return f"the generation engine does not run {name!r} under context parallelism (a gathered latent)"
        return None

    def _setup(self) -> None:
        a = self.backbone.layers[0].self_attn
        self.heads = a.kv_b_proj.out_features // (a.nope + a.v_dim)
        self.rank, self.rope_dim = a.rank, a.rope_dim

    def new_pool(self, num_blocks: int, block_size: int, seqs: int = 1) -> BlockPool:
        # the latent and the shared rope key (with the layer's extras): one "head" each
        slots = [((1, self.rank), (1, self.rope_dim + self._extra_slot(i))) for i in range(self.num_layers)]
        return BlockPool(num_blocks, block_size, slots, self.dtype, self.device)

    def _kv_b(self, a: MLAttention) -> torch.Tensor:
        """kv_b_proj's weight (H, nope + v, rank) as the layer applies it now (read per call: training changes
        it). A wrapped projection (LoRA, quantized) gives its effective weight applied to the identity: a
        product with an identity row adds exact zeros, so a plain Linear's weight comes back bit for bit."""
        lin = a.kv_b_proj
        if type(lin) is nn.Linear:
            w = lin.weight
        else:
            w = lin(torch.eye(self.rank, dtype=self.dtype, device=self.device)).t()
        return w.view(self.heads, a.nope + a.v_dim, self.rank)

    def _qkv(self, layer: MLADecoderLayer, w_k: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        """One tile (TILE, C) -> [queries in latent space | rope (H, rank + rope) | latent | k_rope | the
        layer's `_index_tile`]."""
        a, T = layer.self_attn, x.shape[0]
        h = layer.input_layernorm(x)
        q_resid = None
        if hasattr(a, "q_proj"):
            q = a.q_proj(h)
        else:
            q_resid = a.q_a_layernorm(a.q_a_proj(h))
            q = a.q_b_proj(q_resid)
        q_pass, q_rot = q.view(T, self.heads, -1).split([a.nope, a.rope_dim], -1)  # (T, H, nope), (T, H, rope)
        latent, k_rot = a.kv_a_proj_with_mqa(h).split([a.rank, a.rope_dim], -1)
        latent = a.kv_a_layernorm(latent)
        q_rot, k_rot = a.rope_fn(q_rot, k_rot[:, None], cos, sin)  # cos (T, rope): over heads
        q_lat = torch.matmul(q_pass.transpose(0, 1), w_k).transpose(0, 1)  # (T, H, rank): (T x nope) @ W_k per head
        return torch.cat([torch.cat([q_lat, q_rot], -1).flatten(1), latent, k_rot.flatten(1),
                          *self._index_tile(layer, h, q_resid, cos, sin)], 1)

    def _index_tile(self, layer: MLADecoderLayer, h: torch.Tensor, q_resid: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """A layer's own per-token extras after k_rope, the first `_extra_slot(i)` of them cached beside it
        (the sparse-attention indexer's, kiln.engine.dsa); none for dense latent attention."""
        return []

    def _extra_slot(self, i: int) -> int:
        """How many numbers layer i caches per token beside its rope key."""
        return 0

    def _keep(self, i: int, group: int, extras: torch.Tensor, cached: torch.Tensor, pos: torch.Tensor
              ) -> torch.Tensor | None:
        """The keys each query row of an attention group may read (`exact.attend`'s keep), or None: all."""
        return None

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        """x (N, C) -> (N, C). `kv(i, latent, k_rope)` stores this step's latent (N, 1, rank) and rope keys
        (N, 1, rope (+ the layer's extra slot)) and returns the attention groups, as for the attention runner."""
        layer = self.backbone.layers[i]
        a, H, R, P = layer.self_attn, self.heads, self.rank, self.rope_dim
        w = self._kv_b(a)
        w_k, w_v = w[:, :a.nope], w[:, a.nope:].transpose(1, 2)  # (H, nope, rank), (H, rank, v)
        qkv = tiled(lambda t, c, s: self._qkv(layer, w_k, t, c, s), x, cos, sin)
        q = qkv[:, :H * (R + P)].view(-1, 1, H, R + P)  # one shared key head read by H query heads
        off = H * (R + P) + R
        width = P + self._extra_slot(i)
        latent, stored = qkv[:, off - R:off].view(-1, 1, R), qkv[:, off:off + width].view(-1, 1, width)
        extras = qkv[:, off + width:]
        y = q.new_empty((x.shape[0], H * R))
        for g, (s, e, pos, lat, cached) in enumerate(kv(i, latent, stored)):
            keep = self._keep(i, g, extras[s:e], cached, pos)
            y[s:e] = attend(q[s:e], torch.cat([lat, cached[..., :P]], -1), lat, pos, a.scaling, keep).flatten(1)
        mlp = self.mlps[i]

        def post(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
            o = torch.matmul(yt.view(-1, H, R).transpose(0, 1), w_v).transpose(0, 1)  # (T, H, v): out of the latent
            xt = xt + a.o_proj(o.flatten(1))
            return xt + mlp(layer.post_attention_layernorm(xt))

        return tiled(post, x, y)
