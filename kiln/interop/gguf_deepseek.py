"""DeepSeek-V3 as llama.cpp's `deepseek2`: multi-head latent attention and the sigmoid, group-limited MoE.

What llama.cpp's deepseek2 loader and graph expect, and what kiln writes for it:
- MLA runs "absorbed": the KV latent is one shared head (`head_count_kv = 1`, key length kv_lora_rank +
  qk_rope_head_dim, value length kv_lora_rank), with the per-head sizes under the `_mla` keys. HF's
  `kv_b_proj` (n_head x (nope + v), kv_lora_rank) is split per head into `attn_k_b` (n_head, kv_lora_rank, nope:
  the k half transposed) and `attn_v_b` (n_head, v, kv_lora_rank).
- Without a query latent (`q_lora_rank` None) the file says `q_lora_rank = 0` and carries `attn_q`; llama.cpp reads
  the key unless the model has a "lite" layer count, so it is always written.
- llama.cpp rotates adjacent pairs here. DeepSeek's weights are in that order already (`rope_interleave`, the
  release's default); a model with `rope_interleave = false` gets its rope rows (the last qk_rope_head_dim rows of
  each query head and of `kv_a_proj_with_mqa`) re-ordered.
- MoE layers: sigmoid gating (`expert_gating_func`), the balancing bias as `exp_probs_b.bias`, group-limited
  routing (`expert_group_count` / `expert_group_used_count`; left out when every group is kept, which llama.cpp
  asserts against), `routed_scaling_factor`, `norm_topk_prob`, shared experts; the first `first_k_dense_replace`
  layers are dense.
- Multi-token-prediction layers (past num_hidden_layers) are not written: the main model is what llama.cpp runs.

GLM-5 (`glm-dsa`) is the same layout plus the DSA lightning indexer (its q_b, k with a biased LayerNorm, the per-head
weights; rope on its first dims, adjacent pairs), the indexer keys and the full / shared layer types.
DeepSeek-V3.2 (`deepseek32`) is GLM-5's layout with an indexer in every layer (no types key) whose rope turns
halves (NEOX), as kiln's deepseek_v32 does; its loader reads `yarn_log_multiplier` like deepseek2's.
"""

from __future__ import annotations

import re

import gguf
import torch

from kiln.interop.gguf_layout import (
    Tensors,
    attention_hparams,
    permute_heads,
    rope_hparams,
    routed_expert_hparams,
    stack_experts,
    yarn_problem,
)

_MTP = re.compile(r"model\.layers\.(\d+)\.")


def mla_hparams(w: gguf.GGUFWriter, c) -> None:
    rope = c.rope_parameters or {}
    attention_hparams(w, c, c.intermediate_size, 1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank,
                      c.qk_rope_head_dim)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    rope_hparams(w, {"rope_theta": type(c).default_theta, **rope}, c.max_position_embeddings, mla=True)
    w.add_q_lora_rank(c.q_lora_rank or 0)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_leading_dense_block_count(_leading_dense(c))
    routed_expert_hparams(w, c)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.n_group > 1 and c.topk_group < c.n_group:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)


def _leading_dense(c) -> int:
    n = c.num_hidden_layers
    return next((i for i in range(n) if c.is_sparse(i)), n)


def indexer_hparams(w: gguf.GGUFWriter, c) -> None:
    """DeepSeek-V3.2 (deepseek32): deepseek2's keys plus the lightning indexer's (heads, key length, top-k)."""
    mla_hparams(w, c)
    w.add_indexer_head_count(c.index_n_heads)
    w.add_indexer_key_length(c.index_head_dim)
    w.add_indexer_top_k(c.index_topk)


def dsa_hparams(w: gguf.GGUFWriter, c) -> None:
    """GLM-5 (glm-dsa): the indexer keys plus which layers run their own indexer ("full"; the "shared" ones reuse
    the last full layer's choice)."""
    indexer_hparams(w, c)
    w.add_array(f"{w.arch}.attention.indexer.types", [c.sparse_attention(i) == "full"
                                                      for i in range(c.num_hidden_layers)])


def dense_lead(c) -> str | None:
    """llama.cpp's MLA graphs take the dense layers as a leading run (`leading_dense_block_count`)."""
    lead = _leading_dense(c)
    late = [i for i in range(lead, c.num_hidden_layers) if not c.is_sparse(i)]
    if late:
        return (f"layers {late} are dense after MoE layer {lead} (mlp_layer_types); llama.cpp's MLA graphs take the "
                "dense layers as one leading run")
    return None


def dsa_checks(c) -> str | None:
    if not c.q_lora_rank:
        return "q_lora_rank is unset; llama.cpp's glm-dsa needs the query latent (its indexer reads it)"
    if not getattr(c, "index_interleave", True):
        return "index_interleave is false; llama.cpp's glm-dsa indexer rotates adjacent pairs"
    if (c.rope_parameters or {}).get("rope_type", "default") != "default":
        return ("rope_type {!r}: llama.cpp's glm-dsa loader does not read rope.scaling.yarn_log_multiplier (deepseek2's "
                "does), so its YaRN would not scale the softmax as kiln does".format(c.rope_parameters["rope_type"]))
    if c.index_head_dim % 64:
        return (f"index_head_dim {c.index_head_dim}: llama.cpp's glm-dsa rotates the indexer keys in 64-wide "
                "Hadamard blocks")
    return None


def v32_checks(c) -> str | None:
    if getattr(c, "index_interleave", False):
        return "index_interleave is true; llama.cpp's deepseek32 indexer rotates halves (NEOX)"
    if c.index_head_dim % 64:
        return (f"index_head_dim {c.index_head_dim}: llama.cpp's deepseek32 rotates the indexer keys in 64-wide "
                "Hadamard blocks")
    return None


def mla_tensors(hf: Tensors, c) -> Tensors:
    """HF names and layouts -> the ones the gguf name map and llama.cpp's deepseek2 take (see the docstring)."""
    n, heads = c.num_hidden_layers, c.num_attention_heads
    nope, rot, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    out = {k: t for k, t in hf.items() if not ((m := _MTP.match(k)) and int(m.group(1)) >= n)}
    out = stack_experts(out, n, c.n_routed_experts)
    for i in range(n):
        bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if bias in out:  # the name map knows it as `...e_score_correction` + ".bias"
            out[bias[: -len("_bias")] + ".bias"] = out.pop(bias)
        p = f"model.layers.{i}.self_attn."
        kv_b = out.pop(p + "kv_b_proj.weight").reshape(heads, nope + v, c.kv_lora_rank)
        out[p + "k_b_proj.weight"] = kv_b[:, :nope].transpose(1, 2).contiguous()
        out[p + "v_b_proj.weight"] = kv_b[:, nope:].contiguous()
        if not c.interleaved_rope:  # half-split rotary rows -> llama.cpp's adjacent pairs
            q_key = p + ("q_b_proj.weight" if c.q_lora_rank else "q_proj.weight")
            q = out[q_key].reshape(heads, nope + rot, -1).clone()
            q[:, nope:] = torch.stack([permute_heads(h, 1) for h in q[:, nope:]])
            out[q_key] = q.reshape(out[q_key].shape)
            kv_a = out[p + "kv_a_proj_with_mqa.weight"].clone()
            kv_a[c.kv_lora_rank:] = permute_heads(kv_a[c.kv_lora_rank:], 1)
            out[p + "kv_a_proj_with_mqa.weight"] = kv_a
    return out


def mla_rewritten(hf_name: str, c) -> bool:
    """Whether the file holds `hf_name` other than as kiln's matrix (split or re-ordered): no LoRA adapter there."""
    if hf_name.endswith("kv_b_proj.weight"):
        return True
    return not c.interleaved_rope and hf_name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight"))


def mla_yarn(c) -> str | None:
    return yarn_problem(c.rope_parameters or {}, c.max_position_embeddings, mla=True)


def mla_bias(c) -> str | None:
    if c.attention_bias:
        return "attention_bias is true; llama.cpp's deepseek2 has no attention bias tensors"
    return None
