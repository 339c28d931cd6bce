"""Decoder-only language models: the shared config and the family factory.

A decoder family (llama.py, qwen2.py, ...) gives only its deltas: the config fields it adds, the
attention switches (`AttentionSpec`) and the MLP per layer. Module names are HF's, so the key map
is the identity plus any named tensor steps (e.g. stacked MoE experts). The task models are the
ones every causal backbone shares (`common/causal_lm.py`): the base model and backbone + LM head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.causal_lm import CausalLMOutput, DecoderModel, ForCausalLM
from kiln.models.common.decoder import AttentionSpec, Decoder
from kiln.models.common.rope import RotaryEmbedding, rope_parameters
from kiln.models.config import FamilyConfig
from kiln.models.keymap import KeyMap, Rule, Stack
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.pretrained import Family, TaskSpec
from kiln.models.tasks import BASE, CAUSAL_LM, SEQUENCE_CLASSIFICATION

__all__ = [
    "DECODER_PLAN",
    "SPECIALS",
    "CausalLMOutput",
    "DecoderConfig",
    "DecoderModel",
    "ForCausalLM",
    "base_attention",
    "build_decoder",
    "decoder_family",
]


@dataclass
class DecoderConfig(FamilyConfig):
    """The fields every decoder family shares, under HF's names."""
    default_theta: ClassVar[float] = 10000.0

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] | None = None
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if out.get("head_dim") is None:  # Qwen2 reads a present-but-null head_dim as the head size
            out.pop("head_dim", None)
        return out

    def rope(self, source: str = "config.json") -> dict[str, Any]:
        return rope_parameters(self.rope_parameters, self.extra, self.max_position_embeddings, self.default_theta, source)

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that RoPE turns, in pairs (so it must be even)."""
        return self.dim_head

    def check_sizes(self, source: str) -> None:
        """Sizes a from-config model is built from: each a whole number >= 1, and the rotary dims even (an odd
        head_dim would fail deep in RoPE's first forward with a shape error that names no key)."""
        self.check_whole_sizes(source)  # also here: a config changed after loading is validated alone
        for name, want, fits in (("rms_norm_eps", "> 0", lambda v: v > 0),
                                 ("attention_dropout", ">= 0 and < 1", lambda v: 0 <= v < 1),
                                 ("initializer_range", ">= 0", lambda v: v >= 0)):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and fits(value)):  # a NaN eps turns every step NaN; a dropout of 2 fails at the forward
                raise ConfigError(f"{source}: {name} must be a finite number {want}, got {value!r}")
        r = self.rotary_dim
        if r % 2:
            from_what = (f"head_dim ({self.head_dim})" if self.head_dim is not None else
                         f"hidden_size / num_attention_heads ({self.hidden_size} / {self.num_attention_heads})")
            part = "" if r == self.dim_head else f", of which RoPE turns {r}"
            raise ConfigError(f"{source}: RoPE turns a head's dims in pairs, so they must be even; {from_what} gives "
                              f"{self.dim_head} dims per head{part}: make head_dim even")

    def validate(self, source: str = "config.json") -> None:
        if not (isinstance(self.num_attention_heads, int) and self.num_attention_heads >= 1) or not (
                isinstance(self.kv_heads, int) and self.kv_heads >= 1):
            self.check_sizes(source)  # names the head count that is not a whole number >= 1
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                              f"({self.num_attention_heads}) when head_dim is not given")
        self.check_sizes(source)
        if self.extra.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported (sliding-window attention)")
        self.rope(source)


AttentionFn = Callable[[Any], AttentionSpec]
MlpFn = Callable[[Any, int], nn.Module]


def build_decoder(c: DecoderConfig, attention: AttentionFn, mlp: MlpFn) -> Decoder:
    rope = RotaryEmbedding(c.dim_head, c.rope(), c.max_position_embeddings)
    return Decoder(c.vocab_size, attention(c), c.num_hidden_layers, lambda i: mlp(c, i), rope, c.pad_token_id)


def base_attention(c: DecoderConfig, **switches: Any) -> AttentionSpec:
    return AttentionSpec(c.hidden_size, c.num_attention_heads, c.kv_heads, c.dim_head, eps=c.rms_norm_eps,
                         dropout=c.attention_dropout, **switches)


# Tiny test tokenizers of the decoders: ids 0-3 (llama: bos 1, eos 2 as LlamaConfig's defaults)
SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


# Module names are HF's: the base map is the identity over the three top-level parts.
IDENTITY_KEYS = [("embed_tokens", "embed_tokens"), ("layers.{}", "layers.{}"), ("norm", "norm")]


# Megatron-style tensor parallelism over HF's module names: q/k/v and gate/up split by output
# columns (whole heads, a slice of the hidden units per rank), o_proj and down_proj by input rows.
DECODER_PLAN = ParallelPlan(
    blocks="model.layers",
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    norms=("input_layernorm", "post_attention_layernorm"),
    gathered=(("self_attn", 4), ("mlp", 1)),  # Attention(x, rope, mask, cache), MLP(x)
    embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
    tp_divides=(("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "kv_heads"),
                ("intermediate_size", "intermediate_size")),
)


def decoder_family(model_type: str, config_cls: type[DecoderConfig], arch: str, attention: AttentionFn,
                   mlp: MlpFn, rules: Sequence[Rule | Stack | tuple[str, str]] | None = None, parallel_plan: ParallelPlan = DECODER_PLAN) -> Family:
    """A Family with `base` ({arch}Model), `causal-lm` ({arch}ForCausalLM) and `sequence-classification`
    ({arch}ForSequenceClassification: a reward model is its one-label case) heads."""
    from kiln.models.decoder_seqcls import DecoderForSequenceClassification

    def causal_lm(c):
        return ForCausalLM(build_decoder(c, attention, mlp), c.hidden_size, c.vocab_size, c.tie_word_embeddings)

    def seq_cls(c):
        return DecoderForSequenceClassification(build_decoder(c, attention, mlp), c.hidden_size, c.num_labels)

    return Family(
        model_type=model_type,
        config_cls=config_cls,
        hf_prefix="model",
        base_keys=KeyMap([*(rules or []), *IDENTITY_KEYS]),
        parallel_plan=parallel_plan,
        tasks={
            BASE: TaskSpec(f"{arch}Model", lambda c: DecoderModel(build_decoder(c, attention, mlp))),
            CAUSAL_LM: TaskSpec(f"{arch}ForCausalLM", causal_lm, KeyMap([("lm_head", "lm_head")])),
            SEQUENCE_CLASSIFICATION: TaskSpec(f"{arch}ForSequenceClassification", seq_cls, KeyMap([("score", "score")])),
        },
    )
