"""Layout helpers shared by the GGUF families: rotary row orders, stacked experts, and RoPE metadata.

RoPE scaling in llama.cpp is metadata, not tensors (except llama3's `rope_freqs`): linear is a factor; YaRN is
`rope.scaling.{type, factor, original_context_length}` and, where kiln's attention factor is not YaRN's default
`0.1 ln(factor) + 1`, `rope.scaling.attn_factor` (llama.cpp multiplies its default by it). llama.cpp reads YaRN's
beta_fast / beta_slow only for a few architectures, and always truncates the correction range, so other betas
or `truncate = false` are refused by name. MLA (deepseek2) is stricter: llama.cpp puts YaRN's mscale of
`mscale_all_dim` on the softmax scale (`rope.scaling.yarn_log_multiplier`) and assumes mscale == mscale_all_dim,
i.e. an attention factor of 1 on the rotary part; anything else is refused.
"""

from __future__ import annotations

import math

import gguf
import torch

from kiln.models.common.rope import yarn_mscale

Tensors = dict[str, torch.Tensor]


def permute_heads(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotary order within each head (first half, second half) -> llama.cpp's adjacent pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stack_experts(hf: Tensors, n_layers: int, n_experts: int) -> Tensors:
    """Per-expert HF matrices -> one (E, out, in) tensor per layer and projection, under the merged HF name
    the gguf name map knows (`model.layers.{i}.mlp.experts.gate_proj.weight`)."""
    out = dict(hf)
    for i in range(n_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(n_experts)]
            if names[0] not in out:
                continue
            out[f"model.layers.{i}.mlp.experts.{proj}.weight"] = torch.stack([out.pop(n) for n in names])
    return out


def _yarn_factor(rope: dict, max_positions: int) -> float:
    factor = rope.get("factor")
    return float(factor if factor is not None else max_positions / rope["original_max_position_embeddings"])


def _attention_factor(rope: dict, factor: float) -> float:
    """kiln's YaRN attention factor (kiln.models.common.rope._yarn's rule)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])
    return yarn_mscale(factor)


def yarn_problem(rope: dict, max_positions: int, mla: bool = False) -> str | None:
    """Why llama.cpp would not rotate as kiln does under this YaRN dict, or None (also for other rope types)."""
    if rope.get("rope_type") != "yarn":
        return None
    if (rope.get("beta_fast") or 32) != 32 or (rope.get("beta_slow") or 1) != 1:
        return (f"yarn beta_fast={rope.get('beta_fast')} beta_slow={rope.get('beta_slow')}: llama.cpp reads YaRN's "
                "betas only for a few architectures and uses 32 / 1 here")
    if not rope.get("truncate", True):
        return "yarn truncate=false: llama.cpp always truncates YaRN's correction range"
    if mla:
        factor = _yarn_factor(rope, max_positions)
        a = _attention_factor(rope, factor)
        if not rope.get("mscale_all_dim") or abs(a - 1.0) > 1e-9:
            return (f"yarn with mscale={rope.get('mscale')} mscale_all_dim={rope.get('mscale_all_dim')} "
                    f"(attention factor {a:.4g}): llama.cpp's deepseek2 scales the softmax by mscale_all_dim and "
                    "assumes mscale == mscale_all_dim (attention factor 1), as DeepSeek-V3's release has")
    return None


def rope_hparams(w: gguf.GGUFWriter, rope: dict, max_positions: int, mla: bool = False) -> None:
    """{arch}.rope.freq_base and the scaling keys for linear and YaRN (see the module docstring)."""
    w.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        factor = _yarn_factor(rope, max_positions)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if mla:
            # llama.cpp's deepseek2 divides this key by 0.1 (its converter's legacy convention)
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
        else:
            a = _attention_factor(rope, factor)
            if not math.isclose(a, yarn_mscale(factor), rel_tol=1e-9):
                w.add_rope_scaling_attn_factors(a / yarn_mscale(factor))


def attention_hparams(w: gguf.GGUFWriter, c, ff: int, kv_heads: int, key_length: int, value_length: int,
                      rotary_dim: int) -> None:
    """The shape keys every attention decoder writes ({arch}.context_length, ...), rope's own keys aside."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(key_length)
    w.add_value_length(value_length)
    w.add_rope_dimension_count(rotary_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)


def routed_expert_hparams(w: gguf.GGUFWriter, c) -> None:
    """DeepSeek-style MoE keys: routed experts' size, count and top-k, shared experts, the weights' scale and norm."""
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(float(c.routed_scaling_factor))
    w.add_expert_weights_norm(bool(c.norm_topk_prob))


def decoder_hparams(w: gguf.GGUFWriter, c, rotary_dim: int | None = None) -> None:
    """Attention decoders: hyperparameters under llama.cpp's keys; `rotary_dim` where rope turns only part of each
    head (default: all of it)."""
    attention_hparams(w, c, c.intermediate_size, c.kv_heads, c.dim_head, c.dim_head,
                      c.dim_head if rotary_dim is None else rotary_dim)
    rope_hparams(w, {"rope_theta": type(c).default_theta, **(c.rope_parameters or {})}, c.max_position_embeddings)
