"""How much freed memory glibc keeps in a training process: large blocks go back to the system when freed.

glibc serves a request above its mmap threshold with a mapping of its own, unmapped on free, and the
rest from its heaps, which keep freed memory for reuse. The threshold starts at 128 KiB but rises to
the size of any mapped block freed (up to 32 MiB), so after the first step FSDP2's gathered
parameters, gradients and activations (hundreds of KiB to tens of MiB each) come from the heaps, and
their fragments stay resident. Measured on 1B Qwen3 FSDP2 + LoRA on 2 ranks, 3 steps (benchmarks/bench_load.py,
load average 20-24, one run each): the largest rank's peak RSS 3.62 GiB by default, 2.48 GiB with the threshold
fixed at 64 KiB but 12% more CPU time (103 -> 116 s: every activation mapped and faulted in afresh), 2.61 GiB
at 4 MiB for the same CPU time (104 s). 4 MiB it is: the blocks that pile up are the gathered parameters and
their gradients (MiBs each); the many smaller activations stay on the heap, where reuse is cheap.

`lean_heap()` fixes the threshold (mallopt) for the process that calls it. It pays only where ranks hold
shards of the weights (`pays_off`: FSDP2, tp, ep or pp over several processes), where the gathered
parameters and their gradients pile up; `kiln train` calls it there, before building anything. Elsewhere it
costs time and saves nothing: in one process every activation and gradient above 4 MiB is mapped and
faulted in afresh each step (the MiniLM fine-tune through `kiln train`: 3.8 s a step against 2.9 s with
glibc's own threshold), and the 1-process LoRA peak did not move (bench_load: 2.44 GiB before the setting,
2.45 with it). An explicit MALLOC_MMAP_THRESHOLD_ in the environment is the user's choice and left alone, as
is any non-glibc libc.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from kiln.kernels.libc import glibc
from kiln.parallel.mesh import holds_shards

M_MMAP_THRESHOLD = -3           # mallopt's parameter number (malloc.h)
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own environment spelling of the same setting
LEAN_THRESHOLD = 4 << 20


def lean_heap(threshold: int = LEAN_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; True when it took effect."""
    if os.environ.get(ENV) is not None:
        return False
    mallopt = glibc("mallopt")
    if mallopt is None:  # not glibc (musl has no mallopt): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def pays_off(parallel: Any, world_size: int) -> bool:
    """Whether `lean_heap` pays for this run: its ranks hold shards of the weights (mesh.holds_shards), the runs
    whose peaks the fixed threshold lowers (module docstring)."""
    return holds_shards(parallel, world_size)
