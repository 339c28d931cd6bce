"""Activation bytes of the Qwen3-Next / Qwen3.5 hybrid layers (kiln.models.common.hybrid), per token.

Derived op by op from the code `kiln train` runs (`[train] exact = false`: `delta_rule.chunk_fast` and
`hybrid.tap_conv`; `exact = true`: `delta_rule.chunk_reference` and `ssm.causal_conv1d`) and checked against
autograd's count of saved tensors in tests/parallel/test_memory_plan.py.
Every RMSNorm of these layers but the DeltaNet's output norm is zero-centred: it scales the float32
normalized tensor, so with a trainable weight that tensor is kept in float32 (4 bytes), not the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.parallel.memory_inputs import MLP_TARGETS, ModelDims

DELTA_CHUNK = 32  # delta_rule.chunk_fast's chunk size: its per-chunk tensors cover whole chunks (the last padded)
REFERENCE_CHUNK = 64  # delta_rule.chunk_reference's
DELTANET_INPUTS = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"}


@dataclass(frozen=True)
class HybridDims:
    """The Gated DeltaNet's sizes and which layers are DeltaNets (config.json's `layer_types`)."""
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    linear_layers: frozenset[int]
    conv_kernel: int = 4

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> HybridDims | None:
        """From a Qwen3-Next / Qwen3.5 config.json (its text_config for the image-text ones); None for a config
        without the DeltaNet's sizes (`linear_num_value_heads`: any other family) or without linear-attention
        layers. A missing `layer_types` is every `full_attention_interval`-th layer (4) full."""
        cfg = cfg.get("text_config") or cfg
        if "linear_num_value_heads" not in cfg:
            return None
        n = int(cfg["num_hidden_layers"])
        every = int(cfg.get("full_attention_interval", 4))
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                           for i in range(n)]
        linear = frozenset(i for i, t in enumerate(types) if t == "linear_attention")
        if not linear:
            return None
        return cls(int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_key_head_dim", 128)),
                   int(cfg.get("linear_num_value_heads", 32)), int(cfg.get("linear_value_head_dim", 128)), linear,
                   int(cfg.get("linear_conv_kernel_dim", 4)))


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
                         seq_len: int, down_bytes: int | None = None, exact: bool = False) -> float:
    """Bytes autograd saves per token in one Gated DeltaNet block (its two zero-centred norms, the DeltaNet, the
    MLP) for rows of `seq_len` tokens, on the fast path or (`exact`) the reference one. `targets`: the block's
    LoRA-adapted Linears. The reference rule is exact from two chunks (65 tokens) on; a one-chunk row saves
    slightly less (a chunk slice is then a view of its whole), so there it is an upper bound. In float32 on
    the CPU, torch's matmuls over larger chunks copy some per-chunk operands (hidden 128, 64-wide heads:
    measured 6-7% above this; bfloat16, and float32 at hidden <= 64, equal to the byte)."""
    kd, vd, hv = h.key_heads * h.key_dim, h.value_heads * h.value_dim, h.value_heads
    conv = 2 * kd + vd                 # the short conv's channels: [q | k | v]
    # block norms: fp32 input and rstd; (full) fp32 normalized and the output; LoRA: the output where an adapter reads it
    b: float = 2 * (4 * d.hidden + 4)  # per token: fractions where a row's chunks are padded
    if full:
        b += 2 * d.hidden * (4 + cb)
    else:
        b += d.hidden * cb * (bool(targets & DELTANET_INPUTS) + bool(targets & MLP_TARGETS))
    # MLP: gate, up, silu(gate) and (full or adapted down_proj) their product
    b += 3 * cb * d.intermediate + cb * d.intermediate * (full or "down_proj" in targets)
    b += hv * cb + hv * 4 + hv * 4 * full   # sigmoid(b); softplus(a + dt_bias) input and (A_log trained) output
    # output norm RMSNorm(out) * silu(z): fp32 input, rstd, (full) normalized in the compute dtype, the scaled
    # value, silu(z) and z in fp32; out_proj's input (full or adapted)
    b += vd * 4 + hv * 4 + vd * cb * full + vd * cb + 2 * vd * 4
    b += vd * cb * (full or "out_proj" in targets)
    b += r * (cb if down_bytes is None else down_bytes) * len(targets)
    L = REFERENCE_CHUNK if exact else DELTA_CHUNK
    chunks = math.ceil(seq_len / L)
    pad = chunks * L / seq_len   # per-chunk tensors cover the padded row
    per_row = chunks * hv * h.key_dim * h.value_dim * 4  # the state entering each chunk (float32)
    if exact:
        # conv1d's input and the look-ahead-padded output silu reads; q and k float32 per value head, their rstd
        b += conv * cb + conv * cb * (seq_len + h.conv_kernel - 1) / seq_len + 2 * hv * (h.key_dim + 1) * 4
        # float32 per padded position: decay, the two score products, intra, system (L each); q, k, k*beta, w,
        # q and k decayed (dk); v, u, v_new (dv); beta and three exponentials of the cumulative decay
        b += pad * hv * 4 * (5 * L + 6 * h.key_dim + 3 * h.value_dim + 4)
        per_row += chunks * hv * 4   # each chunk's decay
    else:
        # tap_conv: its input and pre-activation; the rule's q and k (fp32: views of the conv output, whose
        # storage holds v too; half precision: float32 copies of q and k) and their rstd
        b += 2 * conv * cb + (conv * 4 if cb == 4 else 2 * kd * 4) + 2 * h.key_heads * 4
        # _ChunkedDeltaRule, float32 per padded position: decay, attn, kkd, t_inv (L each); qn, kn, w, ke_t (dk);
        # vc, v_new (dv); beta, e_q, e_k; gamma per chunk; the final state beside the chunks' entering ones
        b += pad * hv * 4 * (4 * L + 4 * h.key_dim + 2 * h.value_dim + 3 + 1 / L)
        per_row += hv * h.key_dim * h.value_dim * 4
    return b + per_row / seq_len
