"""Where this process runs (its device, its rank in the world) and the few collective operations the
Trainer needs, as no-ops in a single process.

torchrun (or `kiln launch`) sets RANK / WORLD_SIZE / LOCAL_RANK; with WORLD_SIZE > 1 we join the
process group: gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kiln.errors import KilnError
from kiln.parallel.config import COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


def launched_world() -> World:
    """This process's place as torchrun's environment gives it, without joining the process group (for
    work before the Trainer joins it, e.g. which part of the data a rank reads)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def init_world(device: torch.device, collective_timeout: float = COLLECTIVE_TIMEOUT_S) -> World:
    """Join the process group described by torchrun's environment (once), or stay single.

    `collective_timeout` (seconds, `[parallel] collective_timeout`) bounds every collective: gloo raises in the
    waiting rank, which exits 76 (kiln.cli.common); nccl's watchdog ends the rank (its default async error
    handling), which the launcher reports as a lost peer too."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=collective_timeout))
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


TEARDOWN_S = 120.0  # from the end of a rank's run to its exit; every rank's last save already passed a barrier


def leave_world(code: int = 0, timeout: float = TEARDOWN_S) -> None:
    """End a launched rank once every rank is done: a barrier, then this process exits with `code` at once
    (stdio flushed, `os._exit`). Returns only where there is no process group (a single process).

    Neither `destroy_process_group` nor the interpreter's own teardown runs. With gloo the first can deadlock:
    a worker thread drops the last reference to a finished collective's tensor and waits for the GIL, which the
    main thread holds while it waits for that worker (CI hung so after `done: step 4`, with no Python thread
    able to run); the second sometimes aborts a rank ("terminate called without an active exception"). The
    metrics file and trackers were closed at the end of the run; the kernel closes the sockets.

    A watchdog covers the barrier: a rank still there `timeout` seconds later (a peer that never arrives)
    prints every thread's stack to stderr and exits 70; a C-level one exits 1 a little later should no Python
    thread be able to run."""
    if not dist.is_initialized():
        return
    cancel = _exit_watchdog(timeout, dist.get_rank())
    dist.barrier()
    cancel()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_watchdog(timeout: float, rank: int) -> Callable[[], None]:
    """Arm the watchdogs; returns what disarms them."""
    import faulthandler
    import threading

    def fire() -> None:
        print(f"kiln: rank {rank} did not exit within {timeout:g} s of the end of its run (a peer missing at "
              f"the final barrier, or a hang in teardown); every thread's stack:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(70)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True  # a normal exit does not wait for it
    timer.start()
    faulthandler.dump_traceback_later(timeout + 30, exit=True)  # needs no GIL

    def cancel() -> None:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    return cancel


# What gloo's and the store's errors say when a peer process is gone or a collective timed out: gloo raises a
# plain RuntimeError (no type to tell it by), nccl a DistBackendError, the TCP store a DistNetworkError.
_LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                    "timed out", "Timeout", "connection refused", "Connection refused", "Socket Timeout")


def lost_peer(e: BaseException) -> str | None:
    """Why `e` means this rank lost a peer (a rank killed, a node gone, a collective timing out), in a few
    words; None when it is something else (a bug or a user error keeps its own exit)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if isinstance(e, (getattr(dist, "DistNetworkError", ()), getattr(dist, "DistBackendError", ()))):
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if isinstance(e, RuntimeError) and any(w in str(e) for w in _LOST_PEER_WORDS):
        text = str(e).strip().splitlines()[0]
        return text.split("] ", 1)[-1][:200]  # gloo prefixes its source file and line
    return None


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order (all ranks get the list)."""
    if not world.active:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.active:
        dist.barrier()



def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto`: cuda (this process's local rank), then mps, then cpu; otherwise the named device."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KilnError(f"train.device {name!r} is not a device name (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"train.device is {name!r} but no CUDA device is available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device
