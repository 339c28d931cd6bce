"""Tensor parallelism for the decoder families (llama, qwen2, qwen3): DTensor plans applied to a built model.

Per layer (Megatron style): q/k/v and gate/up are split by output columns, so each rank holds
whole heads and a slice of the MLP's hidden units; o_proj and down_proj are split by input rows and
their partial sums meet in one reduction. Qwen3's per-head q/k norms see only local heads, so their
(replicated) weight is applied to inputs marked sharded along the head axis, which makes autograd
sum its gradient over the ranks.

With `sequence_parallel`, the residual stream between blocks stays split along the sequence: norms
run on T/tp rows each, the attention and MLP inputs are all-gathered, and the row-parallel outputs
are reduce-scattered back to sequence shards. The embedding is split by vocabulary rows and the LM
head by vocabulary columns; the logits come back whole, so the loss code is unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from kiln.errors import ConfigError


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise ConfigError(f"parallel.tp > 1: {type(model).__name__} is not a decoder model (no model.layers)")
    return inner


def layer_plan(layer: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The plan for one DecoderLayer, keyed by submodule name."""
    residual = Shard(1) if sequence_parallel else Replicate()  # (B, T, C): the sequence axis
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel),
    }
    if getattr(layer.self_attn, "q_norm", None) is not None:
        # (B, T, H/tp, D): the head axis is sharded; the norm's weight is replicated
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        # all-gather the sequence before the column-parallel projections; rope and mask pass through
        plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                               desired_input_layouts=(Replicate(), None, None, None),
                                               use_local_output=True)
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Split `model` (a decoder, base or causal-LM) over the 1-D `mesh` in place; returns it."""
    decoder = _decoder(model)
    tp = mesh.size()
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        raise ConfigError("parallel.tp > 1 with tie_word_embeddings = true is not supported: the tied head would "
                          "need vocabulary-parallel logits; untie the head or use fsdp")
    for layer in decoder.layers:
        attn = layer.self_attn
        heads = attn.q_proj.out_features // attn.head_dim
        kv_heads = attn.k_proj.out_features // attn.head_dim
        if heads % tp or kv_heads % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide the model's num_attention_heads ({heads}) "
                              f"and num_key_value_heads ({kv_heads})")
        if hasattr(layer.mlp, "experts"):
            raise ConfigError("parallel.tp > 1 with a MoE layer is not supported; split experts with parallel.ep")
        parallelize_module(layer, mesh, layer_plan(layer, sequence_parallel))
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                        use_local_output=not sequence_parallel),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()  # a base model returns this (B, T, C) DTensor; .full_tensor() gathers it
    parallelize_module(decoder, mesh, top)
    if getattr(model, "lm_head", None) is not None:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(input_layouts=residual,
                                                                    output_layouts=Replicate(),
                                                                    use_local_output=True)})
    return model
