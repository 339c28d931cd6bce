"""Qwen3-Next (llama.cpp's `qwen3next`) and the Qwen3.5 text models (`qwen35`, `qwen35moe`): Gated DeltaNet layers
mixed with gated attention.

What llama.cpp's loaders and graphs expect, and what kiln writes for them:
- the layer schedule as `full_attention_interval` (llama.cpp makes layer i recurrent unless (i + 1) % interval
  == 0); a `layer_types` list that follows no interval is refused by name;
- the DeltaNet sizes as the `ssm.*` keys: state size = key head dim (llama.cpp uses it for the value heads too, so
  the two head dims must be equal), group count = key heads, time-step rank = value heads;
- zero-centred RMSNorms (every norm but the DeltaNet's gated output norm) stored as 1 + w; A as -exp(A_log);
  dt_bias as `ssm_dt.bias`; the depthwise conv kernel as (channels, kernel);
- Qwen3-Next's fused in_proj_qkvz (per key head [q | k | v | z]) split into `attn_qkv` ([all q | all k | all v])
  and `attn_gate` (z), its in_proj_ba kept fused (`ssm_ba`);
- Qwen3.5's value heads re-ordered from grouped by key head (k0: v0 v1, k1: v2 v3) to tiled (v0 v2 v1 v3), the
  order ggml's broadcast uses, in every tensor with a value-head axis (qkv's v rows, z, a, b, A, dt, the conv's v
  channels, out_proj's columns); its multimodal rope as `rope.dimension_sections` (text positions are equal in
  every section, so the split only has to cover the rotary pairs);
- MoE layers (every layer: llama.cpp's qwen3next and qwen35moe graphs have a router in each) with top-k
  renormalised softmax routing and the sigmoid-gated shared expert. Multi-token-prediction tensors are not written.
"""

from __future__ import annotations

import re

import gguf
import torch

from kiln.errors import KilnError
from kiln.interop.gguf_layout import Tensors, decoder_hparams, stack_experts

_MTP = re.compile(r"^(model\.)?mtp\.")


def _interval(c) -> int | None:
    """The full-attention interval `layer_types` follows, or None."""
    n = c.num_hidden_layers
    for k in range(1, n + 1):
        if all((t == "full_attention") == ((i + 1) % k == 0) for i, t in enumerate(c.layer_types)):
            return k
    return None


def _mrope_sections(c) -> list[int]:
    sections = list((c.rope_parameters or {}).get("mrope_section") or [])
    if not sections:  # split the rotary pairs into three, as Qwen3.5's [11, 11, 10] splits 32
        n = c.rotary_dim // 2
        a = -(-n // 3)
        b = -(-(n - a) // 2)
        sections = [a, b, n - a - b]
    return (sections + [0, 0, 0, 0])[:4]


def hybrid_hparams(w: gguf.GGUFWriter, c) -> None:
    decoder_hparams(w, c, c.rotary_dim)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    interval = _interval(c)
    if interval is None:
        raise KilnError(f"--format gguf: {c.model_type}: layer_types {c.layer_types} put full attention at no fixed "
                        "interval; llama.cpp's hybrid reads one (full_attention_interval)")
    w.add_full_attention_interval(interval)
    if hasattr(c, "num_experts"):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.model_type != "qwen3_next":
        w.add_rope_dimension_sections(_mrope_sections(c))


def _tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head: int) -> torch.Tensor:
    """Value heads along `dim` from grouped by key head to tiled (see the module docstring)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def hybrid_tensors(hf: Tensors, c) -> Tensors:
    out: Tensors = {}
    kd, vd, kh, vh = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads, c.linear_num_value_heads
    per_k = vh // kh
    reorder = c.model_type != "qwen3_next" and kh != vh
    for key, t in hf.items():
        if _MTP.match(key):
            continue
        if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
            t = t.float() + 1  # zero-centred: the norm scales by 1 + w
        if key.endswith(".A_log"):
            t = -torch.exp(t.float())
        if key.endswith(".dt_bias"):
            key = key[: -len(".dt_bias")] + ".dt_proj.bias"
        if key.endswith("conv1d.weight"):
            t = t.squeeze(1)
        if key.endswith("in_proj_qkvz.weight"):  # Qwen3-Next: per key head [q | k | v | z]
            g = t.reshape(kh, 2 * kd + 2 * per_k * vd, -1)
            q, k, v, z = g.split([kd, kd, per_k * vd, per_k * vd], dim=1)
            base = key[: -len("in_proj_qkvz.weight")]
            out[base + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            out[base + "in_proj_z.weight"] = z.reshape(-1, t.shape[-1])
            continue
        if reorder and ".linear_attn." in key:
            if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                t = torch.cat([t[: 2 * kd * kh], _tiled(t[2 * kd * kh:], 0, kh, per_k, vd)])
            elif key.endswith("in_proj_z.weight"):
                t = _tiled(t, 0, kh, per_k, vd)
            elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", "dt_proj.bias")):
                t = _tiled(t, 0, kh, per_k, 1)
            elif key.endswith("out_proj.weight"):
                t = _tiled(t, 1, kh, per_k, vd)
        out[key] = t
    if hasattr(c, "num_experts"):
        out = stack_experts(out, c.num_hidden_layers, c.num_experts)
    return out


def hybrid_checks(c) -> str | None:
    if _interval(c) is None:
        return (f"layer_types {c.layer_types} follow no full-attention interval; llama.cpp's hybrid graphs place "
                "attention at every interval-th layer")
    if c.linear_key_head_dim != c.linear_value_head_dim:
        return (f"linear_key_head_dim {c.linear_key_head_dim} != linear_value_head_dim {c.linear_value_head_dim}; "
                "llama.cpp's Gated DeltaNet uses one head size for both")
    if c.attention_bias:
        return "attention_bias is true; llama.cpp's hybrid graphs have no attention bias tensors"
    if hasattr(c, "num_experts"):
        if not getattr(c, "norm_topk_prob", True):
            return "norm_topk_prob is false; llama.cpp always renormalises the top-k router weights here"
        if hasattr(c, "is_sparse") and not all(c.is_sparse(i) for i in range(c.num_hidden_layers)):
            return "some layers are dense MLPs (mlp_only_layers / decoder_sparse_step); llama.cpp's graph has a " \
                   "MoE block in every layer"
    return None
