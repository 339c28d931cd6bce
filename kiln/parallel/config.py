"""The [parallel] table of a run config (and its [parallel.cadence] sub-table), validated by pydantic.

It lives here, beside the plans it configures, so `kiln.parallel` reads it typed (`parallelize`,
`resolve_degrees`) and the train layer only embeds it in the run config. `Section` is the base of
every run-config table: unknown keys are errors, assignments are validated; `finite(...)` the type of every
float setting in every table (TOML's `inf` and `nan` are floats, and `beta > 0` lets `inf` through).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator


def finite(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Any:
    """The type of a float setting: finite (inf and nan refused) and within the bounds given; the error reads
    `must be a finite number > 0, got inf` after the key the run-config loader names."""
    given = [(">=", ge, float.__ge__), (">", gt, float.__gt__), ("<=", le, float.__le__), ("<", lt, float.__lt__)]
    bounds = [(op, float(b), f) for op, b, f in given if b is not None]
    want = "a finite number" + "".join(f"{' and' if i else ''} {op} {b:g}" for i, (op, b, _) in enumerate(bounds))

    def check(value: float) -> float:
        if not (math.isfinite(value) and all(f(float(value), b) for _, b, f in bounds)):
            raise ValueError(f"must be {want}, got {value}")
        return value

    return Annotated[float, AfterValidator(check)]


if TYPE_CHECKING:  # finite() builds an Annotated float at run time; the checker sees the float
    Finite = float
    NonNegative = float
    Positive = float
    Fraction = float
    OpenFraction = float
    Dropout = float
else:
    Finite = finite()
    NonNegative = finite(ge=0)
    Positive = finite(gt=0)
    Fraction = finite(ge=0, le=1)       # a share, 0 and 1 included
    OpenFraction = finite(gt=0, lt=1)   # a share strictly between 0 and 1
    Dropout = finite(ge=0, lt=1)

# Seconds a collective (or the first rendezvous of the process group) may wait for a peer before the rank gives
# up and exits 76 (a lost peer): torch's own NCCL default, a third of its gloo one. Long rank-0-only work between
# two collectives (a slow disk under a big checkpoint) needs more; a requeue script learns of a hung rank sooner
# with less.
COLLECTIVE_TIMEOUT_S = 600.0


class Section(BaseModel):
    """A TOML table: unknown keys are errors, assignments are validated."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CadenceSection(Section):
    """Adaptive sync cadence for mixed devices (kiln.parallel.cadence); present = on."""
    anchor: int = 1                      # batches per sync of the slowest rank, to start with; then tuned
    target_sync_share: OpenFraction = 0.1       # the anchor grows until syncing takes at most this share of the time
    max_staleness: int = 16              # no rank runs more batches than this between two syncs
    max_batch_diff: int = 8              # a fast rank runs at most this many batches more than the anchor; 0 = lockstep
    average: Literal["params", "grads"] = "params"  # what is averaged (weighted by batches done) at a sync

    @model_validator(mode="after")
    def _check(self) -> CadenceSection:
        if not 1 <= self.anchor <= self.max_staleness:
            raise ValueError(f"parallel.cadence.anchor must be within 1..max_staleness ({self.max_staleness}), "
                             f"got {self.anchor}")
        if not 0.0 < self.target_sync_share < 1.0:
            raise ValueError(f"parallel.cadence.target_sync_share must be within (0, 1), got {self.target_sync_share}")
        if self.max_batch_diff < 0:
            raise ValueError(f"parallel.cadence.max_batch_diff must be >= 0, got {self.max_batch_diff}")
        return self


class ParallelSection(Section):
    """Degrees multiply to the world size (dp 0 = what is left); kiln.parallel.mesh checks them at launch."""
    dp: int = 0          # 0: the world size / (tp * ep)
    tp: int = 1          # tensor parallel: attention heads and MLP columns split over tp ranks
    ep: int = 1          # expert parallel: MoE experts split over ep ranks (which also split the batch)
    pp: int = 1          # pipeline parallel: the blocks split into pp stages, one per rank group
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    microbatches: int = 0                # pp: micro-batches per batch (0: 2 x pp)
    pp_stages: list[int] | None = None   # pp: blocks per stage (None: as even as the blocks allow)
    cp: int = 1          # context parallel: each sequence split over cp ranks (load-balanced causal chunks)
    cp_method: Literal["allgather", "ring"] = "allgather"  # cp: keys/values all-gathered, or passed around a ring
    fsdp: bool = False   # shard parameters, gradients and optimizer state over the dp ranks (FSDP2)
    offload: bool = False                # fsdp: keep sharded parameters and optimizer state in CPU memory
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = None   # fsdp compute dtype; None: the parameters' own (autocast still applies train.precision)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"       # fsdp gradient reduction dtype
    sequence_parallel: bool = True       # tp: norms and residuals split along the sequence (deepseek_v4: stays whole)
    activation_checkpointing: Literal["none", "block", "selective"] = "none"
    checkpoint_every: int = 1            # block: checkpoint every n-th block (1 = all of them)
    compile: bool = False                # torch.compile each block
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # aot_eager: no codegen (tests)
    cadence: CadenceSection | None = None
    collective_timeout: Positive = COLLECTIVE_TIMEOUT_S  # seconds a collective waits for a peer (gloo and nccl)

    @model_validator(mode="after")
    def _check(self) -> ParallelSection:
        for name in ("tp", "ep", "pp", "cp", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ValueError(f"parallel.dp must be >= 0 (0: the rest of the world size), got {self.dp}")
        if self.offload and not self.fsdp:
            raise ValueError("parallel.offload needs parallel.fsdp = true (it offloads FSDP's shards)")
        if self.cadence is not None and (self.tp > 1 or self.ep > 1 or self.pp > 1 or self.cp > 1 or self.fsdp):
            raise ValueError("parallel.cadence is a data-parallel mode; it cannot be combined with tp, ep, pp, cp "
                             "or fsdp")
        if self.microbatches < 0:
            raise ValueError(f"parallel.microbatches must be >= 0 (0: 2 x pp), got {self.microbatches}")
        if self.pp_stages is not None:
            if len(self.pp_stages) != self.pp:
                raise ValueError(f"parallel.pp_stages has {len(self.pp_stages)} entries but parallel.pp = {self.pp}; "
                                 f"give one block count per stage")
            if min(self.pp_stages) < 1:
                raise ValueError(f"parallel.pp_stages {self.pp_stages}: every stage needs at least one block")
        return self
