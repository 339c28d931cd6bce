"""Qwen3.5 / Qwen3.6: the Qwen3-Next hybrid decoder as text models (dense and MoE) and as image-text checkpoints.

Deltas from Qwen3-Next (`qwen3_next.py`):
- DeltaNet projections are separate: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (the common layer);
- rotary is the multimodal one (`mrope_section` interleaved over time/height/width); text tokens
  have one position on all axes, so text positions (B, T) give plain partial rotary;
- dense (`qwen3_5_text`): a gated MLP in every layer; MoE (`qwen3_5_moe_text`): every layer is
  sparse with the sigmoid-gated shared expert, top-k always renormalised;
- released checkpoints are image-text models (`qwen3_5`, `qwen3_5_moe`): config.json nests the
  text model's fields under `text_config`, the text weights sit under `model.language_model.`, next
  to the vision tower (`model.visual.`, kiln's `visual`: qwen3_5_vision.py) and multi-token-prediction
  layers (`mtp.`). kiln reads such a directory as an image-text causal LM (text alone works as before)
  and writes the `mtp.` tensors back untouched, so the export loads in transformers'
  `...ForConditionalGeneration` as the source did;
- the MTP module (`mtp.*`, text-only checkpoints too) trains under `[moe] mtp_weight` (kiln.models.mtp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.decoder import causal_mask
from kiln.models.common.hybrid import HybridDecoderLayer
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe import SharedExpertMoEBlock
from kiln.models.common.norms import ZeroCenteredRMSNorm
from kiln.models.common.rope import MRotaryEmbedding
from kiln.models.decoder_lm import SPECIALS
from kiln.models.keymap import KeyMap, Stack
from kiln.models.mtp import TrainsMtp
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.qwen3_5_vision import ImageTextForCausalLM as VisionTextForCausalLM
from kiln.models.qwen3_5_vision import VisionConfig
from kiln.models.qwen3_moe import EXPERT_KEYS
from kiln.models.qwen3_next import (
    TINY_HYBRID,
    TINY_HYBRID_MOE,
    HybridConfig,
    HybridForCausalLM,
    attention,
    build_hybrid,
    deltanet,
    hybrid_family,
)
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

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        if self.num_experts < 1:  # every layer is sparse here (no dense fallback as Qwen3-Next's num_experts = 0)
            raise ConfigError(f"{source}: num_experts must be an integer >= 1 (every layer routes to experts), "
                              f"got {self.num_experts!r}")


def mixer(c: HybridConfig, layer: int) -> nn.Module:
    return deltanet(c, layer) if c.layer_types[layer] == "linear_attention" else attention(c, layer)


def dense_mlp(c: Qwen3_5TextConfig, layer: int) -> nn.Module:
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


def moe_mlp(c: Qwen3_5MoeTextConfig, layer: int) -> nn.Module:
    return SharedExpertMoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, True,
                                c.shared_expert_intermediate_size, c.hidden_act)


class Qwen3_5MTP(nn.Module):
    """Qwen3.5/3.6's multi-token-prediction module (`mtp.*` in the release), depth 1:

        x_i = fc([pre_fc_norm_embedding(Emb(t_{i+1})); pre_fc_norm_hidden(h_i)])     (B, T, 2C) -> (B, T, C)

    h_i the main model's last (final-normed) hidden state, then one full-attention decoder layer of the
    model's own kind (`mtp.layers.0`, causal over x with the main positions), then `mtp.norm`; the main LM
    head scores the result against t_{i+2}. The norms are zero-centred, as every Qwen3.5 norm."""

    def __init__(self, c: HybridConfig, mlp):
        super().__init__()
        C, eps, n = c.hidden_size, c.rms_norm_eps, c.num_hidden_layers
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(C, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(C, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(attention(c, n), mlp(c, n), C, eps)])
        self.norm = ZeroCenteredRMSNorm(C, eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, rope, mask) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, rope, mask, None, None, None))


_MTP_KEY = re.compile(r"^mtp\.")


class Qwen3_5TrainsMtp(TrainsMtp):
    """What both Qwen3.5 causal LMs (text, image-text) add to the hybrid one: the release's MTP module, carried
    through (`mtp.*`, back to FP8 + scales as read when the release is FP8; they were dequantized with the rest at
    load) until `enable_mtp` makes it live under `[moe] mtp_weight` (kiln.models.mtp), then saved under the same
    names. It reads text positions (MTP on image rows uses the rows' plain positions, not the image grid's)."""
    mtp_depth = re.compile(r"^mtp\.layers\.(\d+)\.")

    @property
    def mtp_module(self) -> Qwen3_5MTP | None:
        return self._modules.get("mtp")

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                           source_task: str | None = None):
        mtp = {k: v for k, v in hf.items() if _MTP_KEY.match(k)}  # carried until enable_mtp: no parameter yet
        report = super().load_hf_state_dict({k: v for k, v in hf.items() if k not in mtp}, source, source_task)
        self.hf_passthrough.update(mtp)
        return report

    def mtp_carried(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in getattr(self, "hf_passthrough", {}).items() if _MTP_KEY.match(k)}

    def new_mtp(self) -> Qwen3_5MTP:
        c, ref = self.config, self.model.embed_tokens.weight
        return Qwen3_5MTP(c, moe_mlp if isinstance(c, Qwen3_5MoeTextConfig) else dense_mlp).to(ref.device, ref.dtype)

    def mtp_released(self, found: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        for k in found:
            del self.hf_passthrough[k]

    def mtp_states(self, out, next_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None) -> torch.Tensor:
        next_embeds = self.model.embed_tokens(next_ids)  # (B, T, C)
        B, T = next_ids.shape
        text, rope_pos = position_ids, position_ids
        if position_ids is not None and position_ids.dim() == 3:  # multimodal (3 or 4, B, T), as the decoder reads
            text = position_ids[0] if position_ids.shape[0] == 4 else None
            rope_pos = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
        if rope_pos is None:
            rope_pos = torch.arange(T, device=next_ids.device).unsqueeze(0)
        mask = causal_mask(B, T, 0, attention_mask, text, next_ids.device)
        rope = self.model.rotary_emb(next_embeds, rope_pos)
        return self.mtp_module(out.last_hidden_state, next_embeds, rope, mask)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        carried = getattr(self, "hf_passthrough", {})
        hf = super().hf_state_dict()
        if getattr(self, "fp8_state", None) is not None and carried:
            hf = {k: v for k, v in hf.items() if k not in carried}
            hf.update(self.fp8_state.export(carried))
        return hf


class TextForCausalLM(Qwen3_5TrainsMtp, HybridForCausalLM):
    """A text-only Qwen3.5 causal LM (`Qwen3_5(Moe)ForCausalLM`) with its release's MTP module."""


class ImageTextForCausalLM(Qwen3_5TrainsMtp, VisionTextForCausalLM):
    """An image-text release (the vision tower live, kiln.models.qwen3_5_vision) with its MTP module."""


# the MTP module's tensors under the release's names (its experts one tensor per expert, or fused as read)
MTP_KEYS = [Stack("mtp.layers.{}.mlp.experts.gate_up_proj",
                  ("mtp.layers.{}.mlp.experts.{}.gate_proj.weight", "mtp.layers.{}.mlp.experts.{}.up_proj.weight")),
            Stack("mtp.layers.{}.mlp.experts.down_proj", ("mtp.layers.{}.mlp.experts.{}.down_proj.weight",)),
            ("mtp", "mtp")]

TEXT = hybrid_family("qwen3_5_text", Qwen3_5TextConfig, ("Qwen3_5TextModel", "Qwen3_5ForCausalLM"), mixer, dense_mlp,
                     rope_cls=MRotaryEmbedding, causal_cls=TextForCausalLM, causal_rules=MTP_KEYS
                     ).with_tiny(Tiny(TINY_HYBRID, specials=SPECIALS))
MOE_TEXT = hybrid_family("qwen3_5_moe_text", Qwen3_5MoeTextConfig, ("Qwen3_5MoeTextModel", "Qwen3_5MoeForCausalLM"),
                         mixer, moe_mlp, EXPERT_KEYS, rope_cls=MRotaryEmbedding, causal_cls=TextForCausalLM,
                         causal_rules=MTP_KEYS).with_tiny(Tiny(TINY_HYBRID_MOE, specials=SPECIALS))


# ---- image-text checkpoints ---------------------------------------------------------------------
if TYPE_CHECKING:  # the mixin always sits in front of a family config (Qwen3_5Config, Qwen3_5MoeConfig)
    from kiln.models.common.config import FamilyConfig
    _ConfigBase = FamilyConfig
else:
    _ConfigBase = object


class ImageTextConfig(_ConfigBase):
    """config.json with the text model under `text_config`: the typed fields are the text model's;
    everything else (vision_config, token ids, ...) is kept in `outer` and written back as read."""
    text_model_type: ClassVar[str] = ""
    outer: dict[str, Any]                  # set by from_dict (not dataclass fields: this mixin is no dataclass)
    text_tie_word_embeddings: bool | None

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
        if cfg.outer.get("vision_config") is not None:  # the tower's sizes too, before anything is built
            VisionConfig.from_dict(cfg.outer["vision_config"], f"{source} (vision_config)")
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


def image_text_family(model_type: str, config_cls: type, arch: str, text: Family, mlp) -> Family:
    """Only the causal-LM head ({arch}ForConditionalGeneration): the text model under `model.language_model`,
    the vision tower under `model.visual`."""
    def build(c):
        vision = (VisionConfig.from_dict(c.outer["vision_config"], "config.json (vision_config)")
                  if c.outer.get("vision_config") is not None else None)
        if vision is not None and vision.out_hidden_size != c.hidden_size:
            raise ConfigError(f"config.json: vision_config.out_hidden_size ({vision.out_hidden_size}) must equal "
                              f"text_config.hidden_size ({c.hidden_size})")
        return ImageTextForCausalLM(build_hybrid(c, mixer, mlp, MRotaryEmbedding), c.hidden_size, c.vocab_size,
                                    c.tie_word_embeddings, vision, c.outer.get("image_token_id", 248056),
                                    c.outer.get("video_token_id", 248057))

    return Family(model_type=model_type, config_cls=config_cls, hf_prefix="model.language_model",
                  base_keys=text.base_keys,
                  tasks={CAUSAL_LM: TaskSpec(f"{arch}ForConditionalGeneration", build,
                                               KeyMap(MTP_KEYS + [("lm_head", "lm_head"),
                                                                  ("visual", "model.visual")]))})


# Tiny image-text checkpoints: the tiny text model plus a one-block vision tower
TINY_VISION = dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
                                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                      num_position_embeddings=16),
                   image_token_id=95, video_token_id=96, vision_start_token_id=97, vision_end_token_id=98)

FAMILY = image_text_family("qwen3_5", Qwen3_5Config, "Qwen3_5", TEXT, dense_mlp).with_tiny(
    Tiny(dict(TINY_VISION, text_config=TINY_HYBRID), specials=SPECIALS))
MOE_FAMILY = image_text_family("qwen3_5_moe", Qwen3_5MoeConfig, "Qwen3_5Moe", MOE_TEXT, moe_mlp).with_tiny(
    Tiny(dict(TINY_VISION, text_config=TINY_HYBRID_MOE), specials=SPECIALS))
