"""Activation bytes of the Qwen3-Next / Qwen3.5 hybrid layers (kiln.models.common.hybrid), per token.

Derived op by op from the code `kiln train` runs (`[train] exact = false`: `delta_rule.chunk_fast` and
`hybrid.tap_conv`) and checked against autograd's count of saved tensors in tests/parallel/test_memory_plan.py.
Every RMSNorm of these layers but the DeltaNet's output norm is zero-centred: it scales the float32
normalized tensor, so with a trainable weight that tensor is kept in float32 (4 bytes), not the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from kiln.parallel.memory_inputs import MLP_TARGETS, ModelDims

DELTA_CHUNK = 32  # delta_rule.chunk_fast's chunk size: its per-chunk tensors cover whole chunks (the last padded)
DELTANET_INPUTS = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"}


@dataclass(frozen=True)
class HybridDims:
    """The Gated DeltaNet's sizes and which layers are DeltaNets (config.json's `layer_types`)."""
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    linear_layers: frozenset[int]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "HybridDims | None":
        """From a Qwen3-Next / Qwen3.5 config.json (its text_config for the image-text ones); None without
        linear-attention layers. A missing `layer_types` is every `full_attention_interval`-th layer (4) full."""
        cfg = cfg.get("text_config") or cfg
        n = int(cfg["num_hidden_layers"])
        every = int(cfg.get("full_attention_interval", 4))
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                           for i in range(n)]
        linear = frozenset(i for i, t in enumerate(types) if t == "linear_attention")
        if not linear:
            return None
        return cls(int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_key_head_dim", 128)),
                   int(cfg.get("linear_num_value_heads", 32)), int(cfg.get("linear_value_head_dim", 128)), linear)


def gated_attention_extra(d: ModelDims, cb: int, full: bool, targets: set[str]) -> int:
    """What GatedAttention saves per token beyond `block_activation_bytes`' attention block: q_norm's float32
    input is a view of q_proj's output, whose storage holds the gate too (cb = 4; in half precision the input
    is a float32 copy of the query alone); the sigmoid gate, the attention output it multiplies and (full or
    an adapted o_proj) their product, o_proj's input; with trainable norm weights, the zero-centred norms'
    float32 normalized tensors (both block norms, q_norm and k_norm)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    b = q * 4 * (cb == 4) + 2 * q * cb + q * cb * (full or "o_proj" in targets)
    if full:
        b += (4 - cb) * (2 * d.hidden + q + kv)
    return b


def deltanet_block_bytes(d: ModelDims, h: HybridDims, cb: int, full: bool, targets: set[str], r: int,
                         seq_len: int, down_bytes: int | None = None) -> float:
    """Bytes autograd saves per token in one Gated DeltaNet block (its two zero-centred norms, the DeltaNet on
    the fast path, the MLP) for rows of `seq_len` tokens. `targets`: the block's LoRA-adapted Linears."""
    kd, vd, hv = h.key_heads * h.key_dim, h.value_heads * h.value_dim, h.value_heads
    conv = 2 * kd + vd                 # the short conv's channels: [q | k | v]
    L = DELTA_CHUNK
    pad = math.ceil(seq_len / L) * L / seq_len  # per-chunk tensors cover the padded row
    # block norms: fp32 input and rstd; (full) fp32 normalized and the output; LoRA: the output where an adapter reads it
    b = 2 * (4 * d.hidden + 4)
    if full:
        b += 2 * d.hidden * (4 + cb)
    else:
        b += d.hidden * cb * (bool(targets & DELTANET_INPUTS) + bool(targets & MLP_TARGETS))
    # MLP: gate, up, silu(gate) and (full or adapted down_proj) their product
    b += 3 * cb * d.intermediate + cb * d.intermediate * (full or "down_proj" in targets)
    # tap_conv: its input and pre-activation; the rule's q and k (fp32: views of the conv output, whose
    # storage holds v too; half precision: float32 copies of q and k)
    b += 2 * conv * cb + (conv * 4 if cb == 4 else 2 * kd * 4)
    b += hv * cb + hv * 4 + hv * 4 * full   # sigmoid(b); softplus(a + dt_bias) input and (A_log trained) output
    b += 2 * h.key_heads * 4                 # the rule's q and k rstd
    # _ChunkedDeltaRule, float32 per padded position: decay, attn, kkd, t_inv (L each); qn, kn, w, ke_t (dk);
    # vc, v_new (dv); beta, e_q, e_k; gamma per chunk; and the state entering each chunk plus the final one
    b += pad * hv * 4 * (4 * L + 4 * h.key_dim + 2 * h.value_dim + 3 + 1 / L)
    b += (math.ceil(seq_len / L) + 1) * hv * h.key_dim * h.value_dim * 4 / seq_len
    # output norm RMSNorm(out) * silu(z): fp32 input, rstd, (full) normalized in the compute dtype, the scaled
    # value, silu(z) and z in fp32; out_proj's input (full or adapted)
    b += vd * 4 + hv * 4 + vd * cb * full + vd * cb + 2 * vd * 4
    b += vd * cb * (full or "out_proj" in targets)
    b += r * (cb if down_bytes is None else down_bytes) * len(targets)
    return b
