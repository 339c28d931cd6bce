"""Per-block switches: find a model's repeated blocks, checkpoint their activations, compile them.

The blocks are where the family's parallel plan says (`Family.parallel_plan.blocks`); a model
without a plan (an encoder family, a plain nn.Module) has them found as its largest ModuleList.

Both switches replace a block's `forward` on the instance, never its class or its place in the
module tree, so parameter names (and with them checkpoints and HF key maps) stay unchanged.

Activation checkpointing modes:
- "block": keep only each block's input; recompute the block in the backward pass
  (every `every`-th block, so memory and recompute can be traded in between);
- "selective": recompute only the cheap elementwise work (norms, activations, rope, residuals)
  and keep the outputs of matmuls and attention, which are the expensive ones to redo.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kiln.errors import ConfigError
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.pretrained import PreTrainedModel

if TYPE_CHECKING:
    from kiln.models.pretrained import Family

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: recomputing them costs as much as the forward.
SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default,
             _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_flash_attention.default,
             _aten._scaled_dot_product_cudnn_attention.default}
if hasattr(_aten, "_grouped_mm"):
    SAVED_OPS.add(_aten._grouped_mm.default)


def plan_of(model: nn.Module) -> ParallelPlan | None:
    """The parallel plan the model's family declares, or None."""
    if not isinstance(model, PreTrainedModel):
        return None
    return cast("Family", model.family).parallel_plan  # Family.build sets a model's family (FamilySpec: its view)


def model_name(model: nn.Module) -> str:
    """What to call the model in a message: its model_type, else its class."""
    return model.family.model_type if isinstance(model, PreTrainedModel) else type(model).__name__


def part(module: nn.Module, path: str | None) -> nn.Module | None:
    """The submodule at a plan path, or None where this model has none (no such head, a dense layer)."""
    if path is None:
        return None
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def plan_blocks(model: nn.Module, plan: ParallelPlan) -> nn.ModuleList:
    """The blocks `plan` names in `model`; a ConfigError where they are no ModuleList (a pipeline rank's ModuleDict
    of the blocks it keeps: tp and ep, which walk them, do not combine with pp)."""
    blocks = model.get_submodule(plan.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}.{plan.blocks} is a {type(blocks).__name__}, not the list of "
                          "blocks its parallel plan names")
    return blocks


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: where its plan says, else the ModuleList holding the most parameters."""
    plan = plan_of(model)
    if plan is not None:
        return plan_blocks(model, plan)
    best, best_n = None, -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            n = sum(p.numel() for p in module.parameters())
            if n > best_n:
                best, best_n = module, n
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no list of blocks to shard, checkpoint or compile")
    return best


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, selective: bool):
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if selective:
            return checkpoint(forward, *args, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, _policy), **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> int:
    """Checkpoint the blocks of `model` ("none", "block" or "selective"); returns how many blocks changed."""
    if mode == "none":
        return 0
    if mode not in ("block", "selective"):
        raise ConfigError(f"parallel.activation_checkpointing must be none, block or selective, got {mode!r}")
    changed = 0
    for i, block in enumerate(find_blocks(model)):
        if mode == "block" and i % every:
            continue
        block.forward = _checkpointed(block.forward, selective=mode == "selective")
        changed += 1
    return changed


# Inductor's compiled kernels and graphs go to a cache that outlives /tmp, so the cold start (minutes on a
# small CPU) is paid once per model shape and torch version, not once per run; TORCHINDUCTOR_CACHE_DIR wins.
COMPILE_CACHE = Path.home() / ".cache" / "kiln" / "inductor"


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile each block in place (one graph per block type, reused by every layer).

    Off by default (parallel.compile): on CPU it did not win for a BERT-base train step (benchmarks/RESULTS.md)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE))
    blocks = find_blocks(model)
    for block in blocks:
        block.compile(backend=backend, fullgraph=False)
    return len(blocks)
