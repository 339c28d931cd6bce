"""DeepSeek-V3: multi-head latent attention + group-limited sigmoid MoE with shared experts.

Deltas from the Llama-style decoder (`decoder_lm`):
- attention is MLA (`common/mla.py`): low-rank query (or one q_proj without `q_lora_rank`), a
  compressed KV latent, rope on qk_rope_head_dim dims only (interleaved pairs when
  `rope_interleave`), YaRN's mscale**2 on the softmax scale;
- layers >= `first_k_dense_replace` are MoE (`common/moe_routing.py`): sigmoid router with the
  aux-loss-free balancing bias, `n_group`/`topk_group` group limit, `routed_scaling_factor`,
  `n_shared_experts` always-on experts; earlier layers are dense gated MLPs;
- no auxiliary loss joins the LM loss (transformers adds none); `output_router_logits` returns
  the float32 router logits of each MoE layer;
- multi-token-prediction layers (`model.layers.{num_hidden_layers}` and up), which transformers
  ignores, are kept verbatim in `hf_extras` and written back byte for byte, unless training turns
  them into a live MTP layer (`enable_mtp`, common/mtp.py: depth 1, its loss apart in `mtp_loss_parts`).
Experts are stacked in kiln and one tensor per expert on disk, as transformers writes them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.models.common.fp8 import carried_as_loaded
from kiln.models.common.loss import shift_labels
from kiln.models.common.mla import MLADecoder, MLADecoderLayer, MLASpec, softmax_scale
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe_routing import SharedExpertMoE
from kiln.models.common.mtp import MTPLayer, mtp_targets, next_inputs
from kiln.models.common.rope import RotaryEmbedding
from kiln.models.decoder_lm import IDENTITY_KEYS, DecoderConfig, DecoderModel, ForCausalLM
from kiln.models.keymap import KeyMap
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.pretrained import Family, LoadReport, PreTrainedModel, TaskSpec, Tiny, check_tensors, init_module
from kiln.models.qwen3_moe import EXPERT_KEYS  # transformers maps DeepSeek experts as Qwen2/3-MoE's
from kiln.models.tasks import BASE, CAUSAL_LM


@dataclass
class MLAConfig(DecoderConfig):
    """Fields DeepSeek-V3, DeepSeek-V3.2 and GLM-5 share, with DeepSeek-V3's defaults."""
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    output_router_logits: bool = False
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    attention_bias: bool = False

    interleaved_rope = True  # the main attention's rope layout; DeepSeek-V3 makes it a config field

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def mtp_depth(self) -> int:
        """How many multi-token-prediction layers config.json declares (`num_nextn_predict_layers`; 0 if absent)."""
        return int(self.extra.get("num_nextn_predict_layers", self.extra.get("num_mtp_layers", 0)) or 0)

    def sparse_attention(self, layer: int) -> str | None:
        """None (dense attention), "full" (the layer's own indexer) or "shared" (the previous choice)."""
        return None

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim  # MLA: only the rope part of each head turns

    def validate(self, source: str = "config.json") -> None:
        self.rope(source)
        self.check_sizes(source)
        if self.kv_heads != self.num_attention_heads:
            raise ConfigError(f"{source}: num_key_value_heads ({self.kv_heads}) must equal num_attention_heads "
                              f"({self.num_attention_heads}) for latent attention (every head expands the latent)")
        E, G = self.n_routed_experts, self.n_group
        if G < 1 or E % G or E // G < 2:
            raise ConfigError(f"{source}: n_routed_experts ({E}) must split into n_group ({G}) groups of at least "
                              "2 experts (a group scores its best two)")
        if not 1 <= self.topk_group <= G:
            raise ConfigError(f"{source}: topk_group ({self.topk_group}) must be within 1..n_group ({G})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (E // G):
            raise ConfigError(f"{source}: num_experts_per_tok ({self.num_experts_per_tok}) must be within 1.."
                              f"{self.topk_group * (E // G)} (the experts in topk_group={self.topk_group} groups)")


@dataclass
class DeepseekV3Config(MLAConfig):
    model_type = "deepseek_v3"

    rope_interleave: bool = True

    @property
    def interleaved_rope(self) -> bool:  # type: ignore[override]
        return self.rope_interleave


@runtime_checkable
class IndexedConfig(Protocol):
    """The indexer fields of a config whose attention is sparse (DeepSeek-V3.2, GLM-5: `common/dsa.py`)."""
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_interleave: bool


def _indexer(c: MLAConfig) -> tuple[int, int, int, bool]:
    """(heads, head dim, top-k, interleaved rope) of the indexer of a config that attends sparsely."""
    if not isinstance(c, IndexedConfig):
        raise ConfigError(f"{c.model_type}: a layer attends sparsely, but the config has no indexer fields "
                          "(index_n_heads, index_head_dim, index_topk, index_interleave)")
    return c.index_n_heads, c.index_head_dim, c.index_topk, c.index_interleave


def mla_spec(c: MLAConfig, layer: int) -> MLASpec:
    sparse = c.sparse_attention(layer)
    heads, head_dim, topk, interleave = _indexer(c) if sparse else (0, 0, 0, False)  # (MLASpec's defaults)
    return MLASpec(c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                   c.qk_rope_head_dim, c.v_head_dim, softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, c.rope()),
                   bias=c.attention_bias, interleave=c.interleaved_rope, dropout=c.attention_dropout, sparse=sparse,
                   index_heads=heads, index_head_dim=head_dim, index_topk=topk, index_interleave=interleave)


def mlp(c: MLAConfig, layer: int) -> nn.Module:
    if c.is_sparse(layer):
        return SharedExpertMoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                               c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                               c.n_shared_experts, c.hidden_act)
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


def mtp_layer(c: MLAConfig) -> MTPLayer:
    """The depth-1 MTP layer: attention and MLP of the last main layer's kind (an indexer of its own where
    the model attends sparsely: it has no earlier choice to share)."""
    n = c.num_hidden_layers
    return MTPLayer(mla_spec(c, 0), mlp(c, n - 1), n, c.rms_norm_eps)


def build_backbone(c: MLAConfig) -> MLADecoder:
    layers = [MLADecoderLayer(mla_spec(c, i), mlp(c, i), i, c.rms_norm_eps) for i in range(c.num_hidden_layers)]
    rope = RotaryEmbedding(c.qk_rope_head_dim, c.rope(), c.max_position_embeddings)
    always_mask = any(c.sparse_attention(i) for i in range(c.num_hidden_layers))
    return MLADecoder(c.vocab_size, c.hidden_size, layers, c.rms_norm_eps, rope, c.pad_token_id, always_mask)


_LAYER = re.compile(r"layers\.(\d+)\.")


class KeepsMtpLayers(PreTrainedModel):
    """Checkpoint layers past num_hidden_layers (multi-token prediction) go to `hf_extras` untouched."""

    config: MLAConfig

    # A sharded read may hold the FP8 weights a whole load dequantizes as their stored pairs, by reference
    # (kiln.parallel.sharded_carried): exported kept FP8 as held (the release's bytes, as a whole load writes its
    # unchanged pairs back), with no FP8 dequantized as read; taken by `enable_mtp` as dequantized
    # (common/fp8.carried_as_loaded)
    carries_fp8_pairs = True

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                           source_task: str | None = None) -> LoadReport:
        n = self.config.num_hidden_layers
        mtp, rest = {}, {}
        for k, v in hf.items():
            bare = k[len("model."):] if k.startswith("model.") else k
            m = _LAYER.match(bare)
            if m and int(m.group(1)) >= n:
                mtp[bare] = v
            else:
                rest[k] = v
        report = super().load_hf_state_dict(rest, source, source_task)
        self.hf_extras.update(mtp)  # names without the task prefix: hf_state_dict adds it back
        return report


class MLAModel(KeepsMtpLayers, DecoderModel):
    pass


# The checkpoint's copies of the main embedding and head inside the MTP layer (shared, not trained apart).
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class MLAForCausalLM(KeepsMtpLayers, ForCausalLM):
    """Backbone + LM head; the LM loss alone (no aux loss), router logits on request.

    With a live MTP layer (`enable_mtp`), a training forward given labels or targets also leaves
    `mtp_loss_parts` = (cross entropy summed over the t+2 targets, their count); `.loss` is unchanged."""

    mtp_loss_parts: tuple[torch.Tensor, torch.Tensor] | None = None
    model: MLADecoder

    @property
    def mtp(self) -> MTPLayer | None:
        layers, n = self.model.layers, self.model.num_main_layers
        if len(layers) <= n:
            return None
        layer = layers[n]
        if not isinstance(layer, MTPLayer):
            raise KilnError(f"model.layers.{n}: a {type(layer).__name__}, not the multi-token-prediction layer")
        return layer

    def enable_mtp(self, source: str = "the model", fresh: bool = False) -> MTPLayer:
        """Make the depth-1 MTP layer live from the checkpoint's tensors kept in `hf_extras`; with `fresh`
        (a model built from scratch) freshly initialised where the config declares num_nextn_predict_layers
        >= 1. Its tensors leave hf_extras (they are parameters now, saved under the same names)."""
        if self.mtp is not None:
            return self.mtp
        c = self.config
        n = c.num_hidden_layers
        held = {k: v for k, v in self.hf_extras.items() if k.startswith(f"layers.{n}.")}
        found = carried_as_loaded(held, self.fp8_state)  # a sharded read's FP8 pairs: as dequantized
        if not found and not fresh:
            raise ConfigError(f"{source}: the checkpoint has no multi-token-prediction tensors (no "
                              f"model.layers.{n}.* beside its {n} layers) to train")
        if not found and c.mtp_depth < 1:
            raise ConfigError(f"{source}: {c.model_type} built from scratch declares num_nextn_predict_layers = "
                              f"{c.mtp_depth}; set model.config.num_nextn_predict_layers = 1 for an MTP layer")
        if any(int(m.group(1)) > n for k in self.hf_extras if (m := _LAYER.match(k))) or c.mtp_depth > 1:
            raise ConfigError(f"{source}: MTP depth {max(c.mtp_depth, 2)} is declared; kiln trains depth 1 only")
        ref = self.model.embed_tokens.weight
        layer = mtp_layer(c).to(device=ref.device, dtype=ref.dtype)
        if found:
            own = {k: v for k, v in found.items() if k.removeprefix(f"layers.{n}.") not in _MTP_SHARED}
            kiln_sd, unmatched = self.family.keymap(self.task).to_kiln({f"model.{k}": v for k, v in own.items()})
            prefix = f"model.layers.{n}."
            tensors = {k.removeprefix(prefix): v for k, v in kiln_sd.items()}
            expected = layer.state_dict()
            ignored, _ = check_tensors(expected, tensors, set(expected), source, "its MTP layer",
                                       lambda k: f"model.layers.{n}.{k}")
            if ignored or unmatched:
                raise ConfigError(f"{source}: MTP tensor(s) this {c.model_type} MTP layer has no place for: "
                                  f"{', '.join(sorted(prefix + k for k in ignored) + sorted(unmatched))[:300]}")
            with torch.no_grad():
                for k, v in layer.state_dict().items():
                    v.copy_(tensors[k])
            for k in held:
                del self.hf_extras[k]
        else:
            init_module(layer, c.initializer_range)
        self.model.layers.append(layer)
        return layer

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        hf = super().hf_state_dict()
        if self.mtp is not None:  # the checkpoint's copies of the shared embedding and head, as DeepSeek ships them
            n = self.config.num_hidden_layers
            for name, t in zip(_MTP_SHARED, (self.model.embed_tokens.weight, self.output_weight)):
                hf[f"model.layers.{n}.{name}"] = t.detach().clone()
        return hf

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache: Any = None, logits_to_keep: int = 0, output_router_logits: bool | None = None,
                targets: torch.Tensor | None = None):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, labels=labels, cache=cache, logits_to_keep=logits_to_keep,
                              output_router_logits=False, targets=targets)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if output_router_logits:
            main = itertools.islice(self.model.layers, self.model.num_main_layers)
            out.router_logits = tuple(_router_logits(m) for layer in main if isinstance(m := layer.mlp, SharedExpertMoE))
        if self.mtp is not None and self.training and (labels is not None or targets is not None):
            if input_ids is None:
                raise KilnError("the MTP loss embeds the next input token: pass input_ids, not inputs_embeds")
            targets = targets if targets is not None else shift_labels(labels).to(input_ids.device)
            if out.last_hidden_state is None:
                raise KilnError("the MTP loss reads the main model's last hidden state; the forward returned none")
            self.mtp_loss_parts = self.mtp_loss_sum(out.last_hidden_state, input_ids, targets, attention_mask,
                                                    position_ids)
        return out

    def mtp_loss_sum(self, hidden: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross entropy of the MTP layer's t+2 predictions summed over real targets, their count).

        hidden (B, T, C): the main model's last hidden state; targets (B, T): next-token targets."""
        layer = self.mtp
        if layer is None:
            raise KilnError("this model has no live MTP layer (enable_mtp first)")
        next_embeds = self.model.embed_tokens(next_inputs(input_ids))  # (B, T, C)
        rope, mask = self.model.rope_and_mask(next_embeds, attention_mask, position_ids)
        return self.head_loss_sum(layer.predict(hidden, next_embeds, rope, mask), mtp_targets(targets))

    def new_cache(self):
        return self.model.new_cache()


def _router_logits(moe: SharedExpertMoE) -> torch.Tensor:
    """The router logits a MoE layer kept from the forward just run."""
    if moe.router_logits is None:
        raise KilnError("a MoE layer has no router logits: it has not run a forward")
    return moe.router_logits


# Tensor parallel by heads: q_proj / q_b_proj and kv_b_proj split by output columns, o_proj by input rows;
# the latent projections (q_a_proj, kv_a_proj_with_mqa), their norms and the V3.2/GLM-5 indexer replicated.
# Dense MLPs and the shared experts column/row split; routed experts expert-parallel (or replicated over tp).
MLA_PLAN = ParallelPlan(
    blocks="model.layers",
    colwise=("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj",
             "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"),
    shared_by_heads=(("self_attn.kv_a_proj_with_mqa", "kv_lora_rank"),),  # [latent | k_rope]: k_rope feeds every head
    norms=("input_layernorm", "post_attention_layernorm"),
    gathered=(("self_attn", 5), ("mlp", 1)),  # MLAttention(x, rope, mask, cache, shared_topk), MLP(x)
    embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
    experts="mlp.experts",
    tp_divides=(("num_attention_heads", "num_attention_heads"), ("intermediate_size", "intermediate_size"),
                ("moe_intermediate_size", "moe_intermediate_size")),
)


def mla_family(model_type: str, config_cls: type[MLAConfig], arch: str,
               backbone: Callable[[Any], MLADecoder] = build_backbone) -> Family:
    """A Family with `base` ({arch}Model) and `causal-lm` ({arch}ForCausalLM) heads over an MLA backbone."""
    return Family(
        model_type=model_type,
        config_cls=config_cls,
        hf_prefix="model",
        base_keys=KeyMap([*EXPERT_KEYS, *IDENTITY_KEYS]),
        parallel_plan=MLA_PLAN,
        tasks={
            BASE: TaskSpec(f"{arch}Model", lambda c: MLAModel(backbone(c))),
            CAUSAL_LM: TaskSpec(f"{arch}ForCausalLM",
                                  lambda c: MLAForCausalLM(backbone(c), c.hidden_size, c.vocab_size,
                                                           c.tie_word_embeddings),
                                  KeyMap([("lm_head", "lm_head")])),
        },
    )


# Tiny test tokenizers of the MLA families: bos 0, eos 1 as their configs' defaults
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def random_bias(name: str, tensor: torch.Tensor, g: torch.Generator) -> torch.Tensor | None:
    """Balancing biases drawn at random (transformers starts them at zero), so a bias dropped or added in the
    wrong place changes which experts are picked."""
    return torch.randn(tensor.shape, generator=g) * 0.3 if name.endswith("e_score_correction_bias") else None


# MLA + group-limited sigmoid MoE: no query latent (q_proj), yarn rope with mscale on the softmax scale, 4 expert
# groups (2 kept), 2 shared experts, layer 0 dense
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                 topk_group=2, n_shared_experts=2, first_k_dense_replace=1, max_position_embeddings=64,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                      mscale_all_dim=1.0, original_max_position_embeddings=16)),
            specials=SPECIALS, randomize=random_bias, router_layers=1)

FAMILY = mla_family("deepseek_v3", DeepseekV3Config, "DeepseekV3").with_tiny(TINY)
