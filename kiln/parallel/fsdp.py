"""FSDP2: shard parameters, gradients and optimizer state over the data-parallel ranks, block by block.

Each block is its own `fully_shard` unit (all-gathered just before it runs, freed right after),
then the root takes what is left (embeddings, final norm, head). Parameters become DTensors
sharded on dim 0; gradients are reduce-scattered and averaged over the mesh, as DDP averages them.
After tensor parallelism on a 2-D mesh, FSDP shards the tp-local pieces over the dp dimension.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from kiln.parallel.blocks import find_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: str | None = None, reduce_dtype: str = "fp32",
               offload: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` over the 1-D `mesh` in place: one unit per block, the root last; returns the model.

    `param_dtype` is the dtype blocks compute in (None: the parameters' own); `reduce_dtype` the
    dtype gradients are reduced in; `offload` keeps the shards and their gradients in CPU memory
    (the optimizer step then runs on the CPU).
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                                  reduce_dtype=DTYPES[reduce_dtype])
    placement: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
    blocks = find_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=placement,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement,
                reshard_after_forward=reshard_after_forward)
    return model
