"""Qwen3-MoE: Qwen3 with sparse MoE MLPs.

- layer i is a MoE block unless i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0;
- softmax router, top `num_experts_per_tok`, renormalised when `norm_topk_prob`;
- experts stacked in kiln (gate_up_proj (E, 2I, C), down_proj (E, C, I)), one tensor per expert
  and projection on disk, as transformers writes them;
- with `output_router_logits`, the load-balancing loss times `router_aux_loss_coef` joins the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from kiln.errors import ConfigError
from kiln.models import qwen3
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe import MoEBlock
from kiln.models.decoder_lm import SPECIALS, decoder_family
from kiln.models.keymap import Stack
from kiln.models.pretrained import Tiny


@dataclass
class Qwen3MoeConfig(qwen3.Qwen3Config):
    model_type = "qwen3_moe"

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> Qwen3MoeConfig:
        # transformers 5 writes the expert count as num_local_experts; older files say num_experts
        data = dict(data)
        if "num_local_experts" in data:
            data["num_experts"] = data.pop("num_local_experts")
        data["mlp_only_layers"] = data.get("mlp_only_layers") or []
        return super().from_dict(data, source)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["num_local_experts"] = out.pop("num_experts")
        return out

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok ({self.num_experts_per_tok}) must be within "
                              f"1..num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def mlp(c: Qwen3MoeConfig, layer: int) -> nn.Module:
    if c.is_sparse(layer):
        return MoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                        c.norm_topk_prob, c.hidden_act)
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


EXPERT_KEYS = [
    Stack("layers.{}.mlp.experts.gate_up_proj",
          ("layers.{}.mlp.experts.{}.gate_proj.weight", "layers.{}.mlp.experts.{}.up_proj.weight")),
    Stack("layers.{}.mlp.experts.down_proj", ("layers.{}.mlp.experts.{}.down_proj.weight",)),
]

# a MoE layer (4 experts, top 2) beside a dense one
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
            specials=SPECIALS, router_layers=1)

FAMILY = decoder_family("qwen3_moe", Qwen3MoeConfig, "Qwen3Moe", qwen3.attention, mlp, EXPERT_KEYS,
                        parallel_plan=replace(qwen3.PARALLEL_PLAN, experts="mlp.experts")  # Qwen3-MoE: experts
                        ).with_tiny(TINY)
