"""One writer per run directory: an exclusive lock on RUN_DIR/kiln.lock, held while `kiln train` runs.

The lock is `fcntl.flock` on an open file: the OS drops it when the process ends, however it ends (a
SIGKILLed run never leaves a stale lock), and a second open of the file (another process, or another
Trainer in this one) conflicts with it. The holder writes its pid, host and start time into the file so a
refused process can say who holds it; a refused process writes nothing, and a run that fails puts the file
back as it found it (removed with the run directory, if it made them and nothing else went in). Under `kiln launch` rank 0 holds it for the run.
Readers (`kiln export --checkpoint`, `kiln plot`) do not take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.train.preempt import process_start_time

LOCK_NAME = "kiln.lock"


class RunLock:
    """The held lock of one run directory; `release()` (or the process's end) frees it."""

    def __init__(self, run_dir: Path, fd: int, made: list[Path], before: tuple[bytes, os.stat_result] | None):
        self.run_dir, self._made, self._before = run_dir, made, before
        self._fd: int | None = fd  # None once released

    def release(self, undo: bool = False) -> None:
        """Free the lock. With `undo` (a run that failed) the lock file goes back to what it was: removed with
        the directories made for it (those left empty) if this process made it, else its previous holder's
        name and time stamps put back, so a refused run leaves the disk as it found it."""
        if self._fd is None:
            return
        if undo:  # still locked meanwhile: no other process can take the lock while this is put back
            path = self.run_dir / LOCK_NAME
            with contextlib.suppress(OSError):
                if self._before is None:
                    path.unlink()
                    for d in self._made:
                        d.rmdir()
                else:
                    data, st = self._before
                    os.ftruncate(self._fd, 0)
                    os.pwrite(self._fd, data, 0)
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):  # the holder is between taking the lock and writing its name
        return "a process that has not written its name yet"


def acquire(run_dir: Path) -> RunLock:
    """Lock `run_dir` (created if missing) for this process, or refuse naming the process that holds it."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()][::-1]  # parents first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False  # no O_TRUNC: the holder's name stays
            except FileNotFoundError:  # removed by a refused run's undo in between: try again
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise KilnError(f"{run_dir} is in use by another kiln train ({holder}); a run directory takes one "
                            "writer: wait for that run to end or stop it, or choose another train.out_dir") from None
        try:  # the file locked must still be the one at the path (not one a refused run removed meanwhile)
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            before = None if created else (os.pread(fd, 1 << 16, 0), os.fstat(fd))
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(process_start_time()))}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
            return RunLock(run_dir, fd, made[::-1], before)
        os.close(fd)


def hold(trainer: Any) -> RunLock | None:
    """The run directory's lock for `trainer`, taken by the main rank only (the one that writes the run files)."""
    if not trainer.world.main or (trainer.resume is not None and not trainer.resume.is_dir()):
        return None  # a resume of a missing directory is refused next, by name; it must not be made here
    return acquire(trainer.out_dir)


def release(trainer: Any, undo: bool = False) -> None:
    """Free `trainer`'s lock, if it holds one (the end of fit(); with `undo`, a setup that was refused)."""
    held = getattr(trainer, "run_lock", None)
    if held is not None:
        held.release(undo)
        trainer.run_lock = None
