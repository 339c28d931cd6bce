"""Qwen3-Next: the hybrid decoder (`common/hybrid.py`) with Qwen3-MoE's experts plus a gated shared expert.

Deltas from Qwen3-MoE:
- `layer_types` schedules the token mixer: "linear_attention" layers are Gated DeltaNets, the rest
  ("full_attention", every `full_attention_interval`-th by default) are attention with a sigmoid
  output gate; rotary turns only the first `partial_rotary_factor` (0.25) of each head's dims;
- every RMSNorm except the DeltaNet's output norm is zero-centred (scale 1 + w);
- DeltaNet projections are fused per key head: in_proj_qkvz holds [q | k | v | z] for each of the
  `linear_num_key_heads` groups (its value heads' v and z side by side), in_proj_ba likewise [b | a];
- sparse layers add `shared_expert` (a gated MLP of `shared_expert_intermediate_size`) scaled by
  sigmoid(`shared_expert_gate`); the router renormalises its top-k (`norm_topk_prob`, on by default);
- multi-token-prediction tensors (`mtp.*`), which transformers ignores, ride along to the export verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.hybrid import GatedAttention, GatedDeltaNet, HybridDecoder, HybridDecoderLayer
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe import SharedExpertMoEBlock
from kiln.models.common.rope import RotaryEmbedding
from kiln.models.decoder_lm import IDENTITY_KEYS, SPECIALS, DecoderConfig, DecoderModel, ForCausalLM
from kiln.models.keymap import KeyMap
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.qwen3_moe import EXPERT_KEYS
from kiln.models.tasks import BASE, CAUSAL_LM

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class HybridConfig(DecoderConfig):
    """What Qwen3-Next and the Qwen3.5 text models share: the DeltaNet sizes and the layer schedule."""
    attn_output_gate: ClassVar[bool] = True  # Qwen3-Next: GatedAttention's q_proj is [query | gate] per head
    plan_activations_caveat: ClassVar[str | None] = (
        "gated attention and the Gated DeltaNet layers are modelled (kiln.parallel.memory_hybrid); MoE layers, "
        "with Qwen3-Next's gated shared expert, take the generic MoE estimate")
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None

    @property
    def rotary_dim(self) -> int:
        # transformers: rope_parameters' factor, else a top-level one, else 0.25
        factor = self.rope().get("partial_rotary_factor", self.extra.get("partial_rotary_factor", 0.25))
        return int(self.dim_head * factor)

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        if self.layer_types is None:  # transformers derives the schedule and drops the interval
            every = self.extra.pop("full_attention_interval", 4)
            self.layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"{source}: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"{source}: layer_types has unsupported kind(s) {bad}; "
                              f"supported: {', '.join(LAYER_TYPES)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"{source}: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")


@dataclass
class Qwen3NextConfig(HybridConfig):
    model_type = "qwen3_next"

    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> Qwen3NextConfig:
        data = dict(data)
        data["mlp_only_layers"] = data.get("mlp_only_layers") or []
        return super().from_dict(data, source)

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok ({self.num_experts_per_tok}) must be within "
                              f"1..num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: q, k, v, z from one in_proj_qkvz and b, a from one in_proj_ba, grouped by key head."""

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, _ = x.shape
        nk, dk, dv, per = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(B, T, nk, 2 * dk + 2 * per * dv)
        ba = self.in_proj_ba(x).view(B, T, nk, 2 * per)
        q, k, v, z = torch.split(qkvz, [dk, dk, per * dv, per * dv], dim=3)
        b, a = torch.split(ba, [per, per], dim=3)
        qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)  # (B, T, 2Kd + Vd), heads in order
        return (qkv, z.reshape(B, T, -1, dv), b.reshape(B, T, self.num_v_heads),
                a.reshape(B, T, self.num_v_heads))


_PER_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class HybridForCausalLM(ForCausalLM):
    """Hybrid decoder + LM head; checkpoint tensors it does not use (multi-token-prediction layers `mtp.*`,
    an image-text checkpoint's vision tower) are held in `hf_passthrough` and saved back byte for byte.

    Released Qwen3.5-MoE checkpoints store each layer's experts fused (gate_up_proj (E, 2I, C),
    down_proj (E, C, I), kiln's own layout); transformers writes one tensor per expert. Both load,
    and the export keeps the layout it was read in.
    """

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                           source_task: str | None = None):
        keymap = self.family.keymap(self.task)
        other = {k: v for k, v in hf.items() if keymap.kiln_name(k) is None}
        report = super().load_hf_state_dict({k: v for k, v in hf.items() if k not in other}, source, source_task)
        self.hf_passthrough = other
        self.fused_experts = any(k.startswith(self.family.hf_prefix + ".") and k.endswith(_FUSED) for k in hf)
        return report

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        hf = super().hf_state_dict()
        if getattr(self, "fused_experts", False):
            hf = {k: v for k, v in hf.items() if not _PER_EXPERT.match(k)}
            for k, v in self.state_dict().items():  # kiln "model.layers..." -> "model.language_model.layers..."
                if k.endswith(_FUSED):  # an MTP module's own (mtp.layers.0...) keep their name
                    hf[k if k.startswith("mtp.") else self.family.hf_prefix + k[len("model"):]] = v
        hf.update(getattr(self, "hf_passthrough", {}))
        return hf


MixerFn = Callable[[Any, int], nn.Module]
MlpFn = Callable[[Any, int], nn.Module]


def deltanet(c: HybridConfig, layer: int, cls: type[GatedDeltaNet] = GatedDeltaNet) -> GatedDeltaNet:
    return cls(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
               c.linear_value_head_dim, c.linear_conv_kernel_dim, layer, c.hidden_act, c.rms_norm_eps)


def attention(c: HybridConfig, layer: int) -> GatedAttention:
    return GatedAttention(c.hidden_size, c.num_attention_heads, c.kv_heads, c.dim_head, layer, c.rms_norm_eps,
                          c.attention_bias, c.attention_dropout)


def mixer(c: Qwen3NextConfig, layer: int) -> nn.Module:
    if c.layer_types is None:
        raise ConfigError(f"{c.model_type}: no layer_types (which layers are linear attention)")
    if c.layer_types[layer] == "linear_attention":
        return deltanet(c, layer, FusedGatedDeltaNet)
    return attention(c, layer)


def mlp(c: Qwen3NextConfig, layer: int) -> nn.Module:
    if c.is_sparse(layer):
        return SharedExpertMoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                    c.norm_topk_prob, c.shared_expert_intermediate_size, c.hidden_act)
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


def build_hybrid(c: HybridConfig, mixer: MixerFn, mlp: MlpFn, rope_cls: type[RotaryEmbedding] = RotaryEmbedding
                 ) -> HybridDecoder:
    layers = [HybridDecoderLayer(mixer(c, i), mlp(c, i), c.hidden_size, c.rms_norm_eps)
              for i in range(c.num_hidden_layers)]
    rope = rope_cls(c.rotary_dim, c.rope(), c.max_position_embeddings)
    return HybridDecoder(c.vocab_size, c.hidden_size, layers, rope, c.rms_norm_eps, c.pad_token_id)


# Routed experts split over ep ranks (shared expert, gates, DeltaNet and attention replicated); no TP plan yet.
HYBRID_PLAN = ParallelPlan(blocks="model.layers", experts="mlp.experts")


def hybrid_family(model_type: str, config_cls: type[HybridConfig], archs: tuple[str, str], mixer: MixerFn,
                  mlp: MlpFn, rules: list | None = None, rope_cls: type[RotaryEmbedding] = RotaryEmbedding,
                  causal_cls: type[HybridForCausalLM] = HybridForCausalLM, causal_rules: list | None = None) -> Family:
    """A Family with `base` and `causal-lm` heads (HF class names `archs`) over the hybrid decoder; the causal LM is
    `causal_cls` with `causal_rules` ahead of its head's (Qwen3.5's trains its MTP module)."""
    def build(c):
        return build_hybrid(c, mixer, mlp, rope_cls)

    return Family(
        model_type=model_type,
        config_cls=config_cls,
        hf_prefix="model",
        base_keys=KeyMap(list(rules or []) + IDENTITY_KEYS),
        parallel_plan=HYBRID_PLAN,
        tasks={
            BASE: TaskSpec(archs[0], lambda c: DecoderModel(build(c))),
            CAUSAL_LM: TaskSpec(archs[1], lambda c: causal_cls(build(c), c.hidden_size, c.vocab_size,
                                                                  c.tie_word_embeddings),
                                KeyMap(list(causal_rules or []) + [("lm_head", "lm_head")])),
        },
    )


# Tiny hybrid decoders (Qwen3-Next, Qwen3.5): a Gated DeltaNet layer (2 key heads serving 4 value heads) then a gated
# attention layer whose rotary turns 4 of its 16 dims; the MoE ones route over 4 experts plus the gated shared
# expert (Qwen3-Next's layer 1 dense).
TINY_HYBRID = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                   layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
TINY_HYBRID_MOE = dict(TINY_HYBRID, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                       num_experts_per_tok=2)

TINY = Tiny(dict(TINY_HYBRID_MOE, mlp_only_layers=[1]), specials=SPECIALS)

FAMILY = hybrid_family("qwen3_next", Qwen3NextConfig, ("Qwen3NextModel", "Qwen3NextForCausalLM"), mixer, mlp,
                       EXPERT_KEYS).with_tiny(TINY)
