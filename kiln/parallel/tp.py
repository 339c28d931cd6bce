"""Tensor parallelism: DTensor plans applied to a built model, from its family's declared parallel plan.

Per block (Megatron style): the plan's column-parallel Linears (q/k/v, gate/up) are split by output
columns, so each rank holds whole heads and a slice of the MLP's hidden units; the row-parallel
ones (o_proj, down_proj) by input rows, their partial sums meeting in one reduction. Per-head
norms (Qwen3's q/k norms) see only local heads, so their (replicated) weight is applied to inputs
marked sharded along the head axis, which makes autograd sum its gradient over the ranks.

With `sequence_parallel`, the residual stream between blocks stays split along the sequence: the
plan's norms run on T/tp rows each, the inputs of its gathered modules (attention, MLP) are
all-gathered, and the row-parallel outputs are reduce-scattered back to sequence shards. The
embedding is split by vocabulary rows and the LM head by vocabulary columns; the logits come back
whole, so the loss code is unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from kiln.errors import ConfigError
from kiln.models.parallel_plan import ParallelPlan
from kiln.parallel.blocks import model_name, part, plan_of


def tensor_plan(model: nn.Module, tp: int) -> ParallelPlan:
    """The model's plan, refusing what tensor parallelism cannot split: no plan, shapes tp does not
    divide, tied embeddings, experts."""
    plan = plan_of(model)
    if plan is None or not plan.tensor_parallel:
        raise ConfigError(f"parallel.tp = {tp}: {model_name(model)} declares no tensor-parallel plan; tensor "
                          f"parallelism is planned for the decoder families (llama, qwen2, qwen3)")
    if any(part(block, plan.experts) is not None for block in model.get_submodule(plan.blocks)):
        raise ConfigError("parallel.tp > 1 with a MoE model is not supported; split its experts with parallel.ep")
    config = model.config
    for key, attr in plan.tp_divides:
        n = getattr(config, attr)
        if n % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide the model's {key} ({n}); choose a tp that divides it")
    if config.tie_word_embeddings:
        raise ConfigError("parallel.tp > 1 with tie_word_embeddings = true is not supported: the tied head would "
                          "need vocabulary-parallel logits; untie the head or use fsdp")
    return plan


def layer_plan(plan: ParallelPlan, sequence_parallel: bool) -> dict[str, Any]:
    """The DTensor styles for one block, keyed by submodule name."""
    residual = Shard(1) if sequence_parallel else Replicate()  # (B, T, C): the sequence axis
    styles: dict[str, Any] = {name: ColwiseParallel() for name in plan.colwise}
    for name in plan.rowwise:
        styles[name] = RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel)
    for name in plan.head_norms:
        # (B, T, H/tp, D): the head axis is sharded; the norm's weight is replicated
        styles[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        for name in plan.norms:
            styles[name] = SequenceParallel()
        for name, inputs in plan.gathered:
            # all-gather the sequence before the column-parallel projections; other inputs (rope, mask) pass through
            rest = (None,) * (inputs - 1)
            styles[name] = PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest),
                                              use_local_output=True)
    return styles


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Split `model` (a base or causal-LM model whose family plans it) over the 1-D `mesh` in place; returns it."""
    plan = tensor_plan(model, mesh.size())
    for block in model.get_submodule(plan.blocks):
        parallelize_module(block, mesh, layer_plan(plan, sequence_parallel))
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        plan.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                        use_local_output=not sequence_parallel),
    }
    if sequence_parallel and plan.final_norm:
        top[plan.final_norm] = SequenceParallel()  # a base model returns this (B, T, C) DTensor; .full_tensor() gathers it
    if part(model, plan.lm_head) is not None:  # the causal-LM head (a base model has none)
        top[plan.lm_head] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True)
    parallelize_module(model, mesh, top)
    return model
