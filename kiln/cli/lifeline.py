"""No orphans: the processes of a `kiln launch` end when the process that started them dies, by any signal.

`kiln launch` runs torchrun in a session of its own (so a terminal's Ctrl-C reaches the launcher alone), which
also means nothing kills torchrun and its ranks when the launcher is SIGKILLed (a scheduler's kill after its grace
period, a user's `kill -9`): they trained on, holding their devices. Linux's parent-death signal closes that gap
without a watchdog thread: torchrun is started with PR_SET_PDEATHSIG = SIGKILL (set between fork and exec; it
survives exec), and each rank sets the same for itself as it starts (its parent is torchrun). The kernel sends it
the moment the parent exits, so a launcher that dies takes torchrun and every rank with it at once; checkpoints
are written atomically, so a save cut short leaves the newest complete one.

Elsewhere (macOS, no prctl) `die_with_parent` does nothing and says so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; True where that is in place.

    `expected_parent`: the pid the parent had when this process was made; a parent that died before the
    request (this process already re-parented) ends this process at once, as the signal would have."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def child_of_launcher(launcher_pid: int):
    """A `preexec_fn` for torchrun: die with the launcher (runs in the child between fork and exec)."""
    def preexec() -> None:
        die_with_parent(launcher_pid)
    return preexec
