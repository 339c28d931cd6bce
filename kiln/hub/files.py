"""File durability, identity and permissions shared by everything that writes runs, shards and checkpoints.

safetensors writes its files readable by their owner only (0600, whatever the umask); `as_umask_allows`
gives such a file the mode an ordinary `open()` would have, so an export on a shared machine is readable
by whoever the user's umask lets read it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable (the directory's own metadata)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it where Linux tells it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # elsewhere: set and restore (a race only with a thread creating files right now)
    os.umask(old)
    return old


def as_umask_allows(path: str | os.PathLike) -> None:
    """Give a file written by a library that forces 0600 the mode open() gives a new file: 0666 & ~umask."""
    os.chmod(path, 0o666 & ~umask())
