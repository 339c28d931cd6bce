"""File durability, identity and permissions shared by everything that writes runs, shards and checkpoints.

safetensors writes its files readable by their owner only (0600, whatever the umask); `as_umask_allows`
gives such a file the mode an ordinary `open()` would have, so an export on a shared machine is readable
by whoever the user's umask lets read it.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from kiln.errors import KilnError


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


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object], *, umask_mode: bool = False) -> Path:
    """`write(tmp)` writes the file under a temporary name beside `path`; it is fsynced (with `umask_mode`, given
    the mode open() would: for writers that force 0600, like safetensors) and renamed to `path`, so a reader sees
    the old file or the whole new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fsync_file(tmp)
    if umask_mode:
        as_umask_allows(tmp)
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` (UTF-8) written to `path` as `write_atomic` writes."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


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


class UnreadableInput(KilnError):
    """An input file that cannot be read: a dangling link, not a regular file, unreadable, or empty."""


def why_unreadable(path: str | os.PathLike, *, empty_ok: bool = True) -> str | None:
    """Why `path` cannot be read as an input file (None: it can). A dangling symbolic link (an unmounted
    NFS path, a moved target), a directory or device where a file is expected, a file the process may not
    read, and (with `empty_ok=False`) an empty file each get their own reason."""
    p = Path(path)
    if p.is_symlink() and not p.exists():
        try:
            os.stat(p)
        except OSError as e:
            if e.errno == errno.ELOOP:  # links that lead back to themselves: nothing at the end to read
                return f"is a symbolic link in a loop (to {os.readlink(p)}, which leads back to itself)"
        return f"is a dangling symbolic link (to {os.readlink(p)}, which does not exist)"
    if not p.exists():
        return "does not exist"
    if not p.is_file():
        return "is not a regular file"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError as e:
        return f"cannot be opened ({e.strerror})"
    if not empty_ok and p.stat().st_size == 0:
        return "is empty"
    return None


def check_readable(path: str | os.PathLike, what: str = "input file", *, empty_ok: bool = True) -> Path:
    """`path`, or UnreadableInput naming it and why it cannot be read."""
    why = why_unreadable(path, empty_ok=empty_ok)
    if why is not None:
        raise UnreadableInput(f"{path}: the {what} {why}")
    return Path(path)


def folder_files(folder: str | os.PathLike, selects: Callable[[Path], bool], *, recursive: bool = False,
                 what: str = "input file", empty_ok: bool = True) -> list[Path]:
    """The files of `folder` whose path `selects` accepts, sorted, after checking every one can be read.

    The one listing every reader of a folder of inputs uses: an entry `selects` accepts that is a dangling
    link, not a regular file, or unreadable is refused naming each such entry, so a run never silently
    trains on part of its data (a `p.is_file()` filter would skip a link into an unmounted share)."""
    folder = Path(folder)
    found, bad = [], []
    for p in sorted(_entries(folder, recursive)):
        dangling = p.is_symlink() and not p.exists()
        # walking a tree, a dangling link without a suffix may be a sub-folder of the data (an unmounted class
        # folder): refused too (a dot-name without a suffix is not taken for one)
        lost_folder = recursive and dangling and not p.suffix and not p.name.startswith(".")
        if not (selects(p) or lost_folder) or (recursive and p.is_dir()):  # a folder's files are entries of their own
            continue
        why = why_unreadable(p, empty_ok=empty_ok)
        if why is None:
            found.append(p)
        else:
            bad.append(f"{p} {why}")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UnreadableInput(f"{folder}: {len(bad)} {what}{'s' if len(bad) > 1 else ''} of this folder cannot be "
                              f"read, so the run would silently use part of its data: {shown}")
    return found


def _entries(folder: Path, recursive: bool) -> list[Path]:
    """`folder`'s entries, and with `recursive` those of every folder below it, linked folders included (a
    folder of documents may be a link to a share; Path.rglob would skip it); a link loop is walked once."""
    if not recursive:
        return list(folder.iterdir())
    out, seen, todo = [], set(), [folder]
    while todo:
        d = todo.pop()
        real = os.path.realpath(d)
        if real in seen:
            continue
        seen.add(real)
        for p in d.iterdir():
            out.append(p)
            if p.is_dir():
                todo.append(p)
    return out
