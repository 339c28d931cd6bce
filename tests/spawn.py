"""Run a function on N local processes joined in a gloo (CPU) or nccl (GPU) group, without torchrun.

For tests and benchmarks: `spawn(fn, 2, args)` calls `fn(rank, world_size, *args)` in each
process with the process group initialised and torchrun's environment variables set, and raises
if any process fails. Results travel back through files the caller chooses.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, threads: int,
           args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, args: tuple = (), backend: str = "gloo", threads: int = 1,
          preload: tuple[str, ...] = ("torch", "torch.distributed.tensor", "kiln.parallel.apply")) -> None:
    """Run `fn(rank, world, *args)` in `world` processes; `fn` must be importable (a module-level function).

    Processes fork from a server that imported `preload` once (importing torch costs seconds per
    process, more than a tiny test's work). Not plain fork: the caller's OpenMP threads would not
    survive it. With CUDA each process starts fresh (spawn), as CUDA requires.
    """
    method = "spawn" if backend == "nccl" else "forkserver"
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    mp.start_processes(_entry, args=(fn, world, free_port(), backend, threads, args), nprocs=world, join=True,
                       start_method=method)
