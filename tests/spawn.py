"""Run a function on N local processes joined in a gloo (CPU) or nccl (GPU) group, without torchrun.

For tests and benchmarks: `spawn(fn, 2, args)` calls `fn(rank, world_size, *args)` in each
process with the process group initialised and torchrun's environment variables set, and raises
if any process fails. Results travel back through files the caller chooses.

The group meets at a TCP store that this (parent) process serves on a port the kernel gives it and
holds until every child is done. Choosing a free port, closing it and letting rank 0 bind it later
raced: in the seconds before rank 0 starts, any other process on the machine (another test's store,
or one of the many ephemeral ports gloo's connections take) can take that port, and the group fails
to form ("address already in use", or ranks meeting another run's store).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def serve_store() -> dist.TCPStore:
    """A TCP store served by this process on a port the kernel picks (`.port`), bound until it is dropped."""
    return dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False)


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, threads: int,
           args: tuple) -> None:
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(HOST, port, world, is_master=False)  # the parent's: bound before any child started
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
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
    store = serve_store()
    try:
        mp.start_processes(_entry, args=(fn, world, store.port, backend, threads, args), nprocs=world, join=True,
                           start_method=method)
    finally:
        del store
