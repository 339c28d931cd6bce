"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's architecture with cross-layer sharing of the sparse choice.

Deltas from DeepSeek-V3.2 (`deepseek_v32.py`):
- `indexer_types[i]` is "full" (layer i runs its own indexer) or "shared" (it reuses the top-k
  keys of the last full layer and has no indexer weights);
- the indexer's rope is interleaved, like the main attention's;
- its own defaults (rms_norm_eps 1e-5, one expert group, wider heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.models.deepseek_v3 import SPECIALS, mla_family, random_bias
from kiln.models.deepseek_v32 import DeepseekV32Config
from kiln.models.pretrained import Tiny

INDEXER_KINDS = ("full", "shared")


@dataclass
class GlmMoeDsaConfig(DeepseekV32Config):
    model_type = "glm_moe_dsa"

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 2048
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    indexer_types: list[str] | None = None

    index_interleave = True  # GLM-5: interleaved rope in the indexer too

    def indexer_kinds(self) -> list[str]:
        """`indexer_types`, else the pattern or frequency schedule it is derived from (as transformers does)."""
        if self.indexer_types is not None:
            return self.indexer_types
        pattern = self.extra.get("index_topk_pattern")
        if pattern is not None:
            return [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern] if isinstance(pattern, str) \
                else list(pattern)
        freq = max(int(self.extra.get("index_topk_freq", 1)), 1)
        offset = int(self.extra.get("index_skip_topk_offset", 2))
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(self.num_hidden_layers)]

    def sparse_attention(self, layer: int) -> str | None:
        return self.indexer_kinds()[layer]

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        types = self.indexer_kinds()
        if len(types) != self.num_hidden_layers or set(types) - set(INDEXER_KINDS) or types[0] != "full":
            raise ConfigError(f"{source}: indexer_types must list {self.num_hidden_layers} entries from "
                              f"{INDEXER_KINDS}, the first 'full' (a shared layer reuses an earlier choice), "
                              f"got {types!r}")


# GLM-5: a shared-indexer layer after a full one, interleaved indexer rope
TINY = Tiny(dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, max_position_embeddings=64, index_topk=5, index_head_dim=16,
                 index_n_heads=2, indexer_types=["full", "shared"],
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, mscale=1.0,
                                      mscale_all_dim=1.0, original_max_position_embeddings=32)),
            specials=SPECIALS, randomize=random_bias, router_layers=1,
            skips={"greedy tokens vs transformers": "kiln generates on its engine, whose indexer keeps the earlier entry on an exact score tie where torch.topk keeps one in no stated order; this tiny config's 2 index heads give exact relu zeros, and the greedy tokens part at token 13 by 7.7e-4 (tests/engine holds the engine to the forward with 8 heads and no tie)"})

FAMILY = mla_family("glm_moe_dsa", GlmMoeDsaConfig, "GlmMoeDsa").with_tiny(TINY)
