"""Llama (1, 2, 3, 3.1+): the decoder scaffold as it is.

Choices: RMSNorm pre-norm; grouped-query attention, optional bias on all four projections
(`attention_bias`); rotary positions (default, linear, llama3 or yarn per `rope_parameters`);
SwiGLU MLP, optional bias (`mlp_bias`); LM head untied unless `tie_word_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models.common.mlp import GatedMLP
from kiln.models.decoder_lm import SPECIALS, DecoderConfig, base_attention, decoder_family
from kiln.models.pretrained import Tiny


@dataclass
class LlamaConfig(DecoderConfig):
    model_type = "llama"

    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    attention_bias: bool = False
    mlp_bias: bool = False
    pretraining_tp: int | None = 1


def attention(c: LlamaConfig):
    return base_attention(c, qkv_bias=c.attention_bias, o_bias=c.attention_bias)


def mlp(c: LlamaConfig, layer: int) -> GatedMLP:
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)


# grouped-query attention (4 heads over 2 kv heads), tied embeddings and llama3 rope
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16)),
            specials=SPECIALS)

FAMILY = decoder_family("llama", LlamaConfig, "Llama", attention, mlp).with_tiny(TINY)
