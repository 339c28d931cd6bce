"""Tensor parallelism: DTensor plans applied to a built model, from its family's declared parallel plan.

Per block (Megatron style): the plan's column-parallel Linears (q/k/v, gate/up; MLA's q_b_proj and
kv_b_proj) are split by output columns, so each rank holds whole heads and a slice of the MLP's
hidden units; the row-parallel ones (o_proj, down_proj) by input rows, their partial sums meeting
in one reduction. Per-head norms (Qwen3's q/k norms) see only local heads, so their (replicated)
weight is applied to inputs marked sharded along the head axis, which makes autograd sum its
gradient over the ranks. MLA's latent projections stay replicated; the rope key they make is shared
by every head, so the part of their gradient that comes back through it is summed over the ranks.
DeepSeek-V4 alike: its query heads split (q_b_proj by columns), the grouped output projection by
whole groups of heads (o_a_proj's rows, declared as a head parameter with the per-head attention
sinks) and o_b_proj by rows; the single key = value head and the compressors stay replicated, the
gradient of their whole output summed over tp.

With `sequence_parallel` (where the plan allows it: DeepSeek-V4's residual stays whole), the residual
stream between blocks stays split along the sequence: the plan's norms run on T/tp rows each, the
inputs of its gathered modules (attention, MLP) are all-gathered, and the row-parallel outputs are
reduce-scattered back to sequence shards. The
embedding is split by vocabulary rows and the LM head by vocabulary columns; the logits come back
whole, so the loss code is unchanged. A tied head is the embedding's own (vocabulary-sharded)
DTensor, so it stays tied: each rank makes the logits of its vocabulary slice, then they are gathered.

Mixture-of-experts blocks: the router sees whole tokens. The MoE module's input is the gathered (or
replicated) sequence, every tp rank routes the same tokens, and its output is cut back to this rank's
sequence shard. The routed experts are replicated over tp, or split by expert parallelism over the
ranks that share a tp rank (the "ep" mesh dimension; see ep.py); either way each tp rank runs them on
its 1/tp share of the routed tokens only and the outputs are all-gathered, so the expert work is split
tp ways too. Their gradients are then partial sums, which `Parallelized.sync_gradients` adds up over
tp. A dense shared expert inside the MoE module is column/row split like an MLP, its output
all-reduced so it can be added to the routed output.

Linears kept FP8 (`[model] fp8 = "keep"`) split as stored (tp_fp8.py): each rank its FP8 rows or columns and
exactly the scale blocks of them, moved as bytes, dequantized per matmul; a split that would cut a scale block
is refused by name, as is any other FP8 tensor a plan would split (`tensor_plan`).
A 4-bit Linear (`[model] quantize`, a bitsandbytes-4bit base) is refused by name: its blocks run over the
flattened weight and its quant state would stay whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from kiln.errors import ConfigError
from kiln.models.common.quant4 import is_4bit
from kiln.models.parallel_plan import ParallelPlan
from kiln.parallel.blocks import model_name, part, plan_blocks, plan_of
from kiln.parallel.tp_fp8 import check_fp8_splits, fp8_splits, split_fp8_linears
from kiln.parallel.tp_lora import LoraColwiseParallel, LoraRowwiseParallel, is_lora


def tensor_plan(model: nn.Module, tp: int) -> ParallelPlan:
    """The model's plan, refusing what tensor parallelism cannot split: no plan, shapes tp does not divide."""
    plan = plan_of(model)
    if plan is None or not plan.tensor_parallel:
        raise ConfigError(f"parallel.tp = {tp}: {model_name(model)} declares no tensor-parallel plan; tensor "
                          f"parallelism is planned for the llama/qwen decoders, qwen3_moe, the MLA families "
                          f"(deepseek_v3, deepseek_v32, glm_moe_dsa) and deepseek_v4")
    _refuse_fp8(model, plan, tp)  # first: what to change is the fp8 mode or the plan, not the tp degree
    _refuse_4bit(model, plan, tp)
    config = model.config
    for key, attr in plan.tp_divides:
        n = getattr(config, attr)
        if n % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide the model's {key} ({n}); choose a tp that divides it")
    check_fp8_splits(model, plan, tp)
    return plan


def _split_tensors(model: nn.Module, plan: ParallelPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer the plan splits or distributes over tp."""
    paths = [p for p in (plan.embedding, plan.lm_head) if p is not None and part(model, p) is not None]
    for i, block in enumerate(plan_blocks(model, plan)):
        paths += [f"{plan.blocks}.{i}.{name}" for name in (*plan.colwise, *plan.rowwise) if part(block, name) is not None]
        for path in plan.head_params:
            owner, _, name = path.rpartition(".")
            if part(block, owner) is not None:
                yield f"{plan.blocks}.{i}.{path}", getattr(block.get_submodule(owner), name)
    for path in paths:
        module = model.get_submodule(path)
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            yield f"{path}.{name}", t


def _refuse_4bit(model: nn.Module, plan: ParallelPlan, tp: int) -> None:
    """A 4-bit Linear (`[model] quantize`, a bitsandbytes-4bit directory) a plan would split is refused: its
    packed bytes run in blocks over the flattened weight, and its quant state would stay whole beside them."""
    for name, t in _split_tensors(model, plan):
        path = name.rpartition(".")[0]
        if is_4bit(model.get_submodule(path)):
            raise ConfigError(
                f"parallel.tp = {tp}: {model_name(model)}'s {path!r} is a 4-bit Linear (packed {tuple(t.shape)} "
                f"{t.dtype}), which tensor parallelism cannot split (its blocks of 64 run over the flattened weight); "
                f"use parallel.tp = 1 (fsdp shards 4-bit bases), or load the base unquantized")


def _refuse_fp8(model: nn.Module, plan: ParallelPlan, tp: int) -> None:
    """An FP8 tensor (`[model] fp8 = "keep"`) a plan would split other than an FP8 Linear's weight and scales
    (tp_fp8.py splits those together) is refused before any split: its scales would not follow it."""
    linears = {path + "." for path, _, _ in fp8_splits(model, plan)}
    for name, t in _split_tensors(model, plan):
        if t.is_floating_point() and t.element_size() == 1 and name.rpartition(".")[0] + "." not in linears:
            raise ConfigError(
                f"parallel.tp = {tp} with model.fp8 = 'keep': {model_name(model)} holds {name!r} "
                f"({tuple(t.shape)}, {t.dtype}) in FP8 with its block scales, which tensor parallelism splits only "
                f"in column- or row-parallel Linears; set model.fp8 = 'dequantize' to split the model by tp, or keep "
                f"it FP8 with parallel.tp = 1 (fsdp shards FP8 weights as bytes, ep splits FP8 experts)")


class _SumGradTail(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last columns from `start` on over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        tail = grad[..., ctx.start:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., ctx.start:] = tail
        return grad, None, None


def _sum_shared_columns(module: nn.Module, start: int, group) -> None:
    module.register_forward_hook(lambda m, args, out: _SumGradTail.apply(out, start, group))


def _split_with_heads(block: nn.Module, path: str, mesh: DeviceMesh) -> None:
    """Replace the parameter at `path` with a DTensor split along its first (head) dim; the module reads its part."""
    owner, _, name = path.rpartition(".")
    module = block.get_submodule(owner)
    p = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                 requires_grad=p.requires_grad))


def _row_sizes(n: int, size: int) -> list[int]:
    """How many of n rows each of `size` ranks takes (the first n % size one more)."""
    base, extra = divmod(n, size)
    return [base + (i < extra) for i in range(size)]


def _gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's rows of x, in rank order (padded to one size for the collective, trimmed after)."""
    buf = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    buf[:x.shape[0]] = x
    parts = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's share of the rows of x (N, ...). Backward: the shares' gradients gathered whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        start = sum(sizes[:rank])
        return x[start:start + sizes[rank]].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows, whole. Backward: this rank's rows of a gradient every rank holds whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
        ctx.start, ctx.n = sum(sizes[:rank]), sizes[rank]
        return _gather_rows(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start:ctx.start + ctx.n].contiguous(), None, None, None


def _share_expert_tokens(experts: nn.Module, mesh: DeviceMesh) -> None:
    """The routed experts of a tp group see whole tokens, but each tp rank runs them on its share of the
    tokens only (Experts(x (N, C), index, weights (N, k)) -> (N, C)); the outputs are gathered whole. Their
    parameters then hold partial gradients, summed over tp by `Parallelized.sync_gradients`."""
    group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    rows: dict[str, list[int]] = {}  # the last forward's row split, for its output hook (a new list each time)

    def take(module: nn.Module, args: tuple) -> tuple:
        x, index, weights = args
        sizes = rows["sizes"] = _row_sizes(x.shape[0], size)
        start = sum(sizes[:rank])
        return (_TakeRows.apply(x, sizes, rank, group), index[start:start + sizes[rank]],
                _TakeRows.apply(weights, sizes, rank, group))

    experts.register_forward_pre_hook(take)
    experts.register_forward_hook(lambda module, args, out: _GatherRows.apply(out, rows["sizes"], rank, group))


def _moe_path(plan: ParallelPlan, block: nn.Module) -> str | None:
    """The path of the block's MoE module (the experts' parent), None for a dense block."""
    if plan.experts is None or part(block, plan.experts) is None:
        return None
    return plan.experts.rpartition(".")[0]


def layer_plan(plan: ParallelPlan, sequence_parallel: bool, block: nn.Module) -> dict[str, Any]:
    """The DTensor styles for one block, keyed by submodule name (paths the block lacks are left out)."""
    def has(name: str) -> bool:
        return part(block, name) is not None

    moe = _moe_path(plan, block)

    def inside_moe(name: str) -> bool:
        return moe is not None and name.startswith(moe + ".")

    residual = Shard(1) if sequence_parallel else Replicate()  # (B, T, C): the sequence axis
    def colwise(name: str) -> ColwiseParallel:  # a LoRA layer splits its adapters with its base (tp_lora.py)
        return (LoraColwiseParallel if is_lora(part(block, name)) else ColwiseParallel)()

    def rowwise(name: str, **kw: Any) -> RowwiseParallel:
        return (LoraRowwiseParallel if is_lora(part(block, name)) else RowwiseParallel)(**kw)

    styles: dict[str, Any] = {name: colwise(name) for name in plan.colwise if has(name)}
    for name in filter(has, plan.rowwise):
        if inside_moe(name):  # a shared expert adds to the routed output, which every tp rank holds whole
            styles[name] = rowwise(name, output_layouts=Replicate(), use_local_output=True)
        else:
            styles[name] = rowwise(name, output_layouts=residual, use_local_output=not sequence_parallel)
    for name in filter(has, plan.head_norms):
        # (B, T, H/tp, D): the head axis is sharded; the norm's weight is replicated
        styles[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        for name in filter(has, plan.norms):
            styles[name] = SequenceParallel()
        for name, inputs in plan.gathered:
            # all-gather the sequence before the column-parallel projections; other inputs (rope, mask) pass through
            rest = (None,) * (inputs - 1)
            if name == moe:  # the router sees whole tokens; the output goes back to this rank's sequence shard
                styles[name] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_input=True,
                    output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False)
            elif has(name):
                styles[name] = PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                                  desired_input_layouts=(Replicate(), *rest), use_local_output=True)
    return styles


class _HasHead(Protocol):
    head: Callable[[torch.Tensor], torch.Tensor]


def _tie_head(model: nn.Module, mesh: DeviceMesh) -> None:
    """Logits against the vocabulary-sharded embedding itself: (B, T, V/tp) per rank, then gathered whole."""
    owner = cast(_HasHead, model)  # apply_tensor_parallel ties a model whose `head` it found callable
    head = owner.head  # the family's own head, bound before it is shadowed on the instance

    def vocab_parallel_head(hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, DTensor):  # without sequence parallelism every rank holds the whole hidden state
            hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        logits = head(hidden.redistribute(mesh, [Replicate()]))  # a DTensor sharded on the vocabulary axis
        assert isinstance(logits, DTensor), "the head over a vocabulary-sharded embedding gives a DTensor"
        return logits.full_tensor()

    owner.head = vocab_parallel_head


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Split `model` (a base or causal-LM model whose family plans it) over the 1-D `mesh` in place; returns it."""
    plan = tensor_plan(model, mesh.size())
    sequence_parallel = sequence_parallel and plan.sequence_parallel
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    split_fp8_linears(model, plan, mesh)  # FP8 weights and their scale grids, as bytes, before the styles
    for block in plan_blocks(model, plan):
        parallelize_module(block, mesh, layer_plan(plan, sequence_parallel, block))
        for path in plan.head_params:
            if part(block, path.rpartition(".")[0]) is not None:
                _split_with_heads(block, path, mesh)
        for name, attr in plan.shared_by_heads:
            if part(block, name) is not None:
                start = 0 if attr is None else getattr(model.config, attr)
                _sum_shared_columns(block.get_submodule(name), start, mesh.get_group())
        experts = part(block, plan.experts)
        if experts is not None:
            _share_expert_tokens(experts, mesh)
    residual = Shard(1) if sequence_parallel else Replicate()
    if plan.embedding is None:
        raise ConfigError(f"{model_name(model)}: its parallel plan names no embedding for tensor parallelism to split")
    top: dict[str, Any] = {
        plan.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                        use_local_output=not sequence_parallel),
    }
    if sequence_parallel and plan.final_norm:
        top[plan.final_norm] = SequenceParallel()  # a base model returns this (B, T, C) DTensor; .full_tensor() gathers it
    if plan.lm_head is not None and part(model, plan.lm_head) is not None:  # the causal-LM head (a base has none)
        top[plan.lm_head] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True)
    parallelize_module(model, mesh, top)
    if part(model, plan.lm_head) is None and callable(getattr(model, "head", None)):  # tied to the embedding
        _tie_head(model, mesh)
    for name, p in model.named_parameters():  # SequenceParallel's replicated norms come back trainable: not so
        if name in frozen:                   # under LoRA (or any frozen base)
            p.requires_grad_(False)
    return model
