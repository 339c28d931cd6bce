"""DeepSeek-V3.2: DeepSeek-V3 plus DeepSeek Sparse Attention (a lightning indexer in every layer).

Deltas from DeepSeek-V3 (`deepseek_v3.py`):
- every layer's attention runs an indexer (`common/dsa.py`: `index_n_heads` heads of
  `index_head_dim`, half-split rope) and attends only to its top `index_topk` keys per query;
- the query is always low-rank (`q_lora_rank` is required: the indexer reads its latent);
- rope in the main attention is always interleaved (no `rope_interleave` field);
- dense vs MoE per layer from `mlp_layer_types` (default: `first_k_dense_replace` dense layers);
- the causal mask is always built, even where SDPA's is_causal would do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.models.deepseek_v3 import SPECIALS, MLAConfig, mla_family, random_bias
from kiln.models.pretrained import Tiny

LAYER_KINDS = ("dense", "sparse")


@dataclass
class DeepseekV32Config(MLAConfig):
    model_type = "deepseek_v32"

    max_position_embeddings: int = 163840
    mlp_layer_types: list[str] | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64

    index_interleave = False  # DeepSeek-V3.2's indexer rotates halves, unlike its main attention

    def is_sparse(self, layer: int) -> bool:
        if self.mlp_layer_types is None:
            return super().is_sparse(layer)
        return self.mlp_layer_types[layer] == "sparse"

    def sparse_attention(self, layer: int) -> str | None:
        return "full"

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        if self.q_lora_rank is None:
            raise ConfigError(f"{source}: q_lora_rank is required for {self.model_type} (the indexer reads the "
                              "query latent)")
        if not 0 < self.qk_rope_head_dim <= self.index_head_dim:
            raise ConfigError(f"{source}: index_head_dim ({self.index_head_dim}) must hold the qk_rope_head_dim "
                              f"({self.qk_rope_head_dim}) rotary dims")
        if self.index_topk < 1:
            raise ConfigError(f"{source}: index_topk must be >= 1, got {self.index_topk}")
        types = self.mlp_layer_types
        if types is not None and (len(types) != self.num_hidden_layers or set(types) - set(LAYER_KINDS)):
            raise ConfigError(f"{source}: mlp_layer_types must list {self.num_hidden_layers} entries from "
                              f"{LAYER_KINDS}, got {types!r}")


# with a query latent and an indexer keeping 4 keys (fewer than the test rows)
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                 topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64,
                 index_topk=4, index_head_dim=16, index_n_heads=2),
            specials=SPECIALS, randomize=random_bias, router_layers=1,
            skips={"greedy tokens vs transformers": "kiln generates on its engine, whose indexer keeps the earlier entry on an exact score tie where torch.topk keeps one in no stated order; this tiny config's 2 index heads give exact relu zeros, and the greedy tokens part (by 0.027 at token 11 on this config; tests/engine holds the engine to the forward with 8 heads and no tie)"})

FAMILY = mla_family("deepseek_v32", DeepseekV32Config, "DeepseekV32").with_tiny(TINY)
