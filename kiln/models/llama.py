"""Llama (1, 2, 3, 3.1+): the decoder scaffold as it is.

Choices: RMSNorm pre-norm; grouped-query attention, optional bias on all four projections
(`attention_bias`); rotary positions (default, linear, llama3 or yarn per `rope_parameters`);
SwiGLU MLP, optional bias (`mlp_bias`); LM head untied unless `tie_word_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models.common.mlp import GatedMLP
from kiln.models.decoder_lm import DecoderConfig, base_attention, decoder_family


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


FAMILY = decoder_family("llama", LlamaConfig, "Llama", attention, mlp)
