"""Qwen2 and Qwen2.5: Llama with one delta.

- bias on the q, k and v projections (never on o_proj, whatever `attention_bias` says).
Sliding-window attention (`use_sliding_window`) is refused by the shared config check.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models.common.mlp import GatedMLP
from kiln.models.decoder_lm import SPECIALS, DecoderConfig, base_attention, decoder_family
from kiln.models.pretrained import Tiny


@dataclass
class Qwen2Config(DecoderConfig):
    model_type = "qwen2"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    num_key_value_heads: int | None = 32


def attention(c: Qwen2Config):
    return base_attention(c, qkv_bias=True, o_bias=False)  # Qwen2: q/k/v biases only


def mlp(c: Qwen2Config, layer: int) -> GatedMLP:
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


# grouped-query attention (4 heads over 2 kv heads), yarn rope
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16)),
            specials=SPECIALS)

FAMILY = decoder_family("qwen2", Qwen2Config, "Qwen2", attention, mlp).with_tiny(TINY)
