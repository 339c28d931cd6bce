"""A family's parallel plan, as data: which modules split how. `kiln.parallel` reads it and applies it.

Paths are module names: `blocks`, `embedding`, `final_norm` and `lm_head` from the task model
(the backbone sits under `model.`), the rest from one block. A path the built model lacks (a head
the task has not, a dense layer without experts) is skipped; nothing here is checked by type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelPlan:
    blocks: str                                  # the repeated blocks (a ModuleList): FSDP units, checkpointing
    # ---- tensor parallel (Megatron style), per block
    colwise: tuple[str, ...] = ()                # Linears split by output features: whole heads / hidden units per rank
    rowwise: tuple[str, ...] = ()                # Linears split by input features; partial sums meet in one reduction
    head_norms: tuple[str, ...] = ()             # norms over head_dim that see only the local heads
    # parameters split with the heads along their first dim (DeepSeek-V4's per-head sinks and grouped output
    # projection, which are no Linears): "<module path>.<parameter>"; the module reads its rank's part
    head_params: tuple[str, ...] = ()
    # replicated modules whose output columns from config.<attr> on (None: all of them) feed every head (MLA's
    # shared rope key, V4's single key = value head): each rank's heads give only part of those columns'
    # gradient, so it is summed over the tp ranks
    shared_by_heads: tuple[tuple[str, str | None], ...] = ()
    # ---- sequence parallel, per block: residual-stream norms, and the modules whose first input is
    # gathered from sequence shards, with how many positional inputs they take
    norms: tuple[str, ...] = ()
    gathered: tuple[tuple[str, int], ...] = ()
    # False: the residual stays whole on every tp rank whatever [parallel] sequence_parallel says (DeepSeek-V4:
    # its hyper-connected streams are mixed per token outside the attention and MoE the plan splits)
    sequence_parallel: bool = True
    # ---- around the blocks, from the task model
    embedding: str | None = None                 # split by vocabulary rows
    final_norm: str | None = None                # sequence parallel
    lm_head: str | None = None                   # split by vocabulary columns; logits come back whole
    # ---- mixture of experts, per block: the stacked `Experts` module of a MoE layer (expert parallel)
    experts: str | None = None
    # config fields tensor parallelism must divide: (name in messages, config attribute)
    tp_divides: tuple[tuple[str, str], ...] = ()

    @property
    def tensor_parallel(self) -> bool:
        return bool(self.colwise or self.rowwise)
