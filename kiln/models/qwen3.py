"""Qwen3 (dense): Llama with one delta.

- RMSNorm over head_dim on q and k (per head), before rotary positions;
- head_dim is its own config field (128 by default), not hidden_size / heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.models.common.mlp import GatedMLP
from kiln.models.decoder_lm import DECODER_PLAN, SPECIALS, DecoderConfig, base_attention, decoder_family
from kiln.models.pretrained import Tiny


@dataclass
class Qwen3Config(DecoderConfig):
    model_type = "qwen3"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    attention_bias: bool = False


def attention(c: Qwen3Config):
    return base_attention(c, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True)  # Qwen3: q/k norms


def mlp(c: Qwen3Config, layer: int) -> GatedMLP:
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


# Qwen3: the q/k norms see only a rank's heads under tensor parallelism
PARALLEL_PLAN = replace(DECODER_PLAN, head_norms=("self_attn.q_norm", "self_attn.k_norm"))

# grouped-query attention (4 heads over 2 kv heads), head_dim != hidden / heads
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
            specials=SPECIALS)

FAMILY = decoder_family("qwen3", Qwen3Config, "Qwen3", attention, mlp, parallel_plan=PARALLEL_PLAN).with_tiny(TINY)
