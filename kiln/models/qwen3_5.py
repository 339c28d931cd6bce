"""Qwen3.5 / Qwen3.6: the Qwen3-Next hybrid decoder as text models (dense and MoE) and as image-text checkpoints.

Deltas from Qwen3-Next (`qwen3_next.py`):
- DeltaNet projections are separate: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (the common layer);
- rotary is the multimodal one (`mrope_section` interleaved over time/height/width); text tokens
  have one position on all axes, so text positions (B, T) give plain partial rotary;
- dense (`qwen3_5_text`): a gated MLP in every layer; MoE (`qwen3_5_moe_text`): every layer is
  sparse with the sigmoid-gated shared expert, top-k always renormalised;
- released checkpoints are image-text models (`qwen3_5`, `qwen3_5_moe`): config.json nests the
  text model's fields under `text_config`, the text weights sit under `model.language_model.`, next
  to the vision tower (`model.visual.`) and multi-token-prediction layers (`mtp.`). kiln reads such
  a directory as a causal LM over the text model and writes every other tensor back untouched,
  so the export loads in transformers' `...ForConditionalGeneration` as the source did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe import SharedExpertMoEBlock
from kiln.models.common.rope import MRotaryEmbedding
from kiln.models.keymap import KeyMap
from kiln.models.decoder_lm import SPECIALS
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.qwen3_moe import EXPERT_KEYS
from kiln.models.qwen3_next import (TINY_HYBRID, TINY_HYBRID_MOE, HybridConfig, HybridForCausalLM, attention,
                                   build_hybrid, deltanet, hybrid_family)
from kiln.models.tasks import CAUSAL_LM


@dataclass
class Qwen3_5TextConfig(HybridConfig):
    model_type = "qwen3_5_text"

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = 4


@dataclass
class Qwen3_5MoeTextConfig(HybridConfig):
    model_type = "qwen3_5_moe_text"

    vocab_size: int = 248320
    num_hidden_layers: int = 40
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001


def mixer(c: HybridConfig, layer: int) -> nn.Module:
    return deltanet(c, layer) if c.layer_types[layer] == "linear_attention" else attention(c, layer)


def dense_mlp(c: Qwen3_5TextConfig, layer: int) -> nn.Module:
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


def moe_mlp(c: Qwen3_5MoeTextConfig, layer: int) -> nn.Module:
    return SharedExpertMoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, True,
                                c.shared_expert_intermediate_size, c.hidden_act)


TEXT = hybrid_family("qwen3_5_text", Qwen3_5TextConfig, ("Qwen3_5TextModel", "Qwen3_5ForCausalLM"), mixer, dense_mlp,
                     rope_cls=MRotaryEmbedding).with_tiny(Tiny(TINY_HYBRID, specials=SPECIALS))
MOE_TEXT = hybrid_family("qwen3_5_moe_text", Qwen3_5MoeTextConfig, ("Qwen3_5MoeTextModel", "Qwen3_5MoeForCausalLM"),
                         mixer, moe_mlp, EXPERT_KEYS, rope_cls=MRotaryEmbedding).with_tiny(Tiny(TINY_HYBRID_MOE,
                                                                                                specials=SPECIALS))


# ---- image-text checkpoints ---------------------------------------------------------------------
class ImageTextConfig:
    """config.json with the text model under `text_config`: the typed fields are the text model's;
    everything else (vision_config, token ids, ...) is kept in `outer` and written back as read."""
    text_model_type: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json"):
        text = dict(data.get("text_config") or {})
        text.pop("model_type", None)
        own_tie = text.get("tie_word_embeddings")
        if "tie_word_embeddings" in data:  # the outer value decides, as in transformers' ForConditionalGeneration
            text["tie_word_embeddings"] = data["tie_word_embeddings"]
        cfg = super().from_dict(text, f"{source} (text_config)")
        cfg.outer = {k: v for k, v in data.items() if k != "text_config"}
        if "quantization_config" in cfg.outer:  # the whole checkpoint's (FP8 release): where the loader looks
            cfg.extra["quantization_config"] = cfg.outer.pop("quantization_config")
        cfg.text_tie_word_embeddings = own_tie
        return cfg

    def to_dict(self) -> dict[str, Any]:
        text = super().to_dict()
        quantization = text.pop("quantization_config", None)  # top level, where it was read (gone when dequantized)
        for key in ("outer", "text_tie_word_embeddings", "architectures"):
            text.pop(key, None)
        text["model_type"] = self.text_model_type
        if self.text_tie_word_embeddings is not None:
            text["tie_word_embeddings"] = self.text_tie_word_embeddings
        out = dict(self.outer)
        out.update(model_type=self.model_type, text_config=text, tie_word_embeddings=self.tie_word_embeddings)
        if quantization is not None:
            out["quantization_config"] = quantization
        return out


@dataclass
class Qwen3_5Config(ImageTextConfig, Qwen3_5TextConfig):
    model_type = "qwen3_5"
    text_model_type = "qwen3_5_text"
    outer: dict[str, Any] = field(default_factory=dict)       # kiln only: config.json minus text_config
    text_tie_word_embeddings: bool | None = None              # kiln only: text_config's own value, written back


@dataclass
class Qwen3_5MoeConfig(ImageTextConfig, Qwen3_5MoeTextConfig):
    model_type = "qwen3_5_moe"
    text_model_type = "qwen3_5_moe_text"
    outer: dict[str, Any] = field(default_factory=dict)
    text_tie_word_embeddings: bool | None = None


class ImageTextForCausalLM(HybridForCausalLM):
    """The text model of an image-text release; the tensors it carries through (vision tower, `mtp.*`) go back
    to FP8 + scales as read when the release is FP8 (they were dequantized with the rest at load)."""

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        carried = getattr(self, "hf_passthrough", {})
        hf = super().hf_state_dict()
        if getattr(self, "fp8_state", None) is not None and carried:
            hf = {k: v for k, v in hf.items() if k not in carried}
            hf.update(self.fp8_state.export(carried))
        return hf


def image_text_family(model_type: str, config_cls: type, arch: str, text: Family, mlp) -> Family:
    """Only the causal-LM head ({arch}ForConditionalGeneration): the text model under `model.language_model`."""
    def build(c):
        return ImageTextForCausalLM(build_hybrid(c, mixer, mlp, MRotaryEmbedding), c.hidden_size, c.vocab_size,
                                    c.tie_word_embeddings)

    return Family(model_type=model_type, config_cls=config_cls, hf_prefix="model.language_model",
                  base_keys=text.base_keys,
                  tasks={CAUSAL_LM: TaskSpec(f"{arch}ForConditionalGeneration", build,
                                               KeyMap([("lm_head", "lm_head")]))})


# Tiny image-text checkpoints: the tiny text model plus a one-block vision tower
TINY_VISION = dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
                                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                      num_position_embeddings=16),
                   image_token_id=95, video_token_id=96, vision_start_token_id=97, vision_end_token_id=98)

FAMILY = image_text_family("qwen3_5", Qwen3_5Config, "Qwen3_5", TEXT, dense_mlp).with_tiny(
    Tiny(dict(TINY_VISION, text_config=TINY_HYBRID), specials=SPECIALS))
MOE_FAMILY = image_text_family("qwen3_5_moe", Qwen3_5MoeConfig, "Qwen3_5Moe", MOE_TEXT, moe_mlp).with_tiny(
    Tiny(dict(TINY_VISION, text_config=TINY_HYBRID_MOE), specials=SPECIALS))
