"""kiln.parallel.memory_heap.lean_heap: with it, a large block glibc would have carved from its heap (the
default threshold lifted by an earlier freed mapping) is a mapping of its own, returned to the system on free;
`kiln train` sets it only where ranks hold shards of the weights (pays_off), not in one process or plain DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.errors import ConfigError
from kiln.parallel.config import ParallelSection
from kiln.parallel.memory_heap import pays_off
from tests.kiln_cli import REPO

CHILD = """
import ctypes, sys, torch
from kiln.parallel.memory_heap import lean_heap

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
took = lean_heap() if sys.argv[1] == "lean" else False
big = torch.ones(30 << 20, dtype=torch.uint8)
del big  # glibc's default threshold rises to the size of a freed mapping: 30 MiB
before = libc.mallinfo2().hblks
block = torch.ones(20 << 20, dtype=torch.uint8)
print(took, libc.mallinfo2().hblks - before)
"""


def _child(mode: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, cwd=REPO,
                       env={**full, "PYTHONPATH": str(REPO), **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's mallopt")
def test_lean_heap_maps_large_blocks_and_leaves_an_explicit_setting_alone():
    assert _child("default") == ["False", "0"]  # control: the 20 MiB block comes from the heap
    assert _child("lean") == ["True", "1"]      # its own mapping, unmapped when freed
    # the user's MALLOC_MMAP_THRESHOLD_ stands (glibc read it at start: 40 MiB keeps the block on the heap)
    assert _child("lean", MALLOC_MMAP_THRESHOLD_=str(40 << 20)) == ["False", "0"]


@pytest.mark.parametrize("table,world,pays", [
    ({}, 1, False), ({"fsdp": True}, 1, False),            # one process: the step pays, no peak falls
    ({}, 2, False),                                        # DDP: every rank holds the whole model
    ({"fsdp": True}, 2, True), ({"tp": 2}, 2, True), ({"ep": 2}, 4, True), ({"pp": 2}, 2, True),
])
def test_lean_heap_only_where_ranks_hold_shards(table, world, pays):
    assert pays_off(ParallelSection(**table), world) is pays


def test_pays_off_refuses_degrees_that_do_not_fit():
    with pytest.raises(ConfigError, match="do not divide the world size"):
        pays_off(ParallelSection(tp=2), 3)
