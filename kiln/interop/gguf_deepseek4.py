"""DeepSeek-V4 as the bundled llama.cpp's `deepseek4`: hyper-connected streams, sink attention over a sliding window
with CSA / HCA compressed keys, hash-routed and sqrt-softplus top-k MoE.

The installed `gguf` package (0.19.0) predates this architecture: it has none of its tensor kinds (hyper-connection
fn / base / scale, the compressors, `attn_kv`, `attn_output_a|b`, `ffn_gate_tid2eid`) nor its keys, so this module
names the tensors and keys itself, as llama.cpp's deepseek4 loader reads them (`src/models/deepseek4.cpp`), and the
gguf package still writes the file. Layouts: kiln's saved (release) tensors are llama.cpp's except
- `wo_a` (o_groups * o_lora_rank, heads * head_dim / o_groups) -> (o_groups, o_lora_rank, ...): one matrix per group;
- the routed experts stacked (E, out, in) per projection; `tid2eid` as int32;
- the scored layers' balancing bias as `exp_probs_b.bias`.
What llama.cpp's graph fixes is checked first (`v4_checks`): 4 hyper-connection streams, compression ratios 4 (CSA)
and 128 (HCA), the hash-routed layers as a leading run, sqrt-softplus scoring, head sizes in 64-wide blocks.
Multi-token-prediction tensors are not written (llama.cpp runs the main model).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import torch

from kiln.interop.gguf_layout import Tensors, attention_hparams, routed_expert_hparams

SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (the gguf package has no member)
RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def v4_hparams(w: gguf.GGUFWriter, c) -> None:
    a, n = w.arch, c.num_hidden_layers
    kinds = c.attention_kinds()
    # one shared key = value head
    attention_hparams(w, c, c.moe_intermediate_size, 1, c.dim_head, c.dim_head, c.rope_dim)
    ropes = c.ropes()
    w.add_rope_freq_base(float(ropes["main"]["rope_theta"]))
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_sliding_window(c.sliding_window)
    routed_expert_hparams(w, c)
    w.add_uint32(f"{a}.expert_gating_func", SQRT_SOFTPLUS)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(c.swiglu_limit)] * n)  # the shared expert's defaults to it
    w.add_indexer_head_count(c.index_n_heads)
    w.add_indexer_key_length(c.index_head_dim)
    w.add_indexer_top_k(c.index_topk)
    w.add_uint32(f"{a}.attention.output_group_count", c.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", c.o_lora_rank)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", float(ropes["compress"]["rope_theta"]))
    w.add_array(f"{a}.attention.compress_ratios", [RATIOS[k] for k in kinds])
    w.add_uint32(f"{a}.hyper_connection.count", c.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", float(c.hc_eps))
    w.add_uint32(f"{a}.hash_layer_count", c.mlp_kinds().count("hash_moe"))


def v4_checks(c) -> str | None:
    if c.hc_mult != 4:
        return f"hc_mult {c.hc_mult}: llama.cpp's deepseek4 graph runs 4 hyper-connection streams"
    rates = c.rates()
    for kind, want in RATIOS.items():
        if want and kind in c.attention_kinds() and rates.get(kind) != want:
            return f"compress_rates[{kind!r}] = {rates.get(kind)}: llama.cpp's deepseek4 loader takes {want} there"
    kinds = c.mlp_kinds()
    lead = next((i for i, k in enumerate(kinds) if k != "hash_moe"), len(kinds))
    if "hash_moe" in kinds[lead:]:
        return (f"mlp_layer_types {kinds}: llama.cpp's deepseek4 takes the hash-routed layers as a leading run "
                "(hash_layer_count)")
    if c.scoring_func != "sqrtsoftplus":
        return f"scoring_func {c.scoring_func!r}: llama.cpp's deepseek4 loader takes sqrtsoftplus only"
    if c.dim_head % 64 or c.index_head_dim % 64:
        return (f"head_dim {c.dim_head} / index_head_dim {c.index_head_dim}: llama.cpp's deepseek4 rotates the "
                "compressed keys in 64-wide Hadamard blocks (checked here at multiples of 64)")
    ropes = c.ropes()
    if any(p["rope_type"] != "default" for p in ropes.values()):
        return ("rope_parameters with YaRN: kiln checks deepseek4 against llama.cpp with plain rope only "
                "(its YaRN on the compressed layers is not verified)")
    return None


def v4_tensors(hf: Tensors, c) -> Iterator[tuple[str, gguf.MODEL_TENSOR | None, torch.Tensor]]:
    """(llama.cpp name, the gguf package's kind where it has one, tensor) for the main model."""
    T = gguf.MODEL_TENSOR
    yield "token_embd.weight", T.TOKEN_EMBD, hf["model.embed_tokens.weight"]
    yield "output_norm.weight", T.OUTPUT_NORM, hf["model.norm.weight"]
    yield "output.weight", T.OUTPUT, hf["head.weight"]
    for part in ("fn", "base", "scale"):
        yield f"output_hc_{part}.weight", None, hf[f"model.hc_head.hc_{part}"]
    for i in range(c.num_hidden_layers):
        yield from _layer(hf, c, i)


_ATTN = {"attn.attn_sink": "attn_sinks", "attn.wq_a.weight": "attn_q_a", "attn.q_norm.weight": "attn_q_a_norm",
         "attn.wq_b.weight": "attn_q_b", "attn.wkv.weight": "attn_kv", "attn.norm.weight": "attn_kv_a_norm",
         "attn.wo_b.weight": "attn_output_b", "attn_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm",
         "ffn.gate.weight": "ffn_gate_inp", "ffn.shared_experts.w1.weight": "ffn_gate_shexp",
         "ffn.shared_experts.w3.weight": "ffn_up_shexp", "ffn.shared_experts.w2.weight": "ffn_down_shexp",
         **{f"hc_{s}_{p}": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
         **{f"attn.compressor.{h}": f"attn_compressor_{g}" for h, g in
            (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
         **{f"attn.indexer.compressor.{h}": f"indexer_compressor_{g}" for h, g in
            (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
         "attn.indexer.wq_b.weight": "indexer.attn_q_b", "attn.indexer.weights_proj.weight": "indexer.proj"}
_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _layer(hf: Tensors, c, i: int) -> Iterator[tuple[str, gguf.MODEL_TENSOR | None, torch.Tensor]]:
    p, q = f"model.layers.{i}.", f"blk.{i}."
    for key, name in _ATTN.items():
        if p + key in hf:
            # the router stays f32 in every type, as the other MoE families' (the exporter's kind list)
            yield f"{q}{name}.weight", gguf.MODEL_TENSOR.FFN_GATE_INP if name == "ffn_gate_inp" else None, hf[p + key]
    wo_a = hf[p + "attn.wo_a.weight"]
    yield f"{q}attn_output_a.weight", None, wo_a.reshape(c.o_groups, c.o_lora_rank, wo_a.shape[-1])
    if p + "ffn.gate.tid2eid" in hf:
        yield f"{q}ffn_gate_tid2eid.weight", None, hf[p + "ffn.gate.tid2eid"].to(torch.int32)
    else:
        yield f"{q}exp_probs_b.bias", None, hf[p + "ffn.gate.bias"]
    for w, name in _EXPERTS.items():
        yield f"{q}{name}.weight", None, torch.stack([hf[f"{p}ffn.experts.{e}.{w}.weight"]
                                                   for e in range(c.n_routed_experts)])
