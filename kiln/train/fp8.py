"""`[train] precision = "fp8"`: which Linears train in FP8, and by which recipe.

The blocks (kiln.parallel.blocks.find_blocks: the plan's, else the largest ModuleList) have their
plain Linears swapped in place, before any parallel plan wraps them, so parameter names, the
optimizer state and checkpoints stay those of the bf16/fp32 run. The FP8 state is the float32
master weights alone (scales are recomputed from them every step), so resume is exact as usual.
"""

from __future__ import annotations

from torch import nn

from kiln.models.common.fp8_train import swap_fp8_linears, swap_torchao
from kiln.parallel.blocks import find_blocks


def swap_fp8(model: nn.Module, recipe: str = "blockwise") -> list[str]:
    """Make the Linears of the model's blocks train in FP8 by `recipe` ("blockwise" or "torchao")."""
    blocks = find_blocks(model)
    return swap_torchao(blocks) if recipe == "torchao" else swap_fp8_linears(blocks)
