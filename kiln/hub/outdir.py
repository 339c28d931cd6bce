"""Output directories: never write over a model, tokenizer, run or shard set unless told to, and
write through a staging folder so a failed write (full disk, no permission) leaves the target as it was.
The staging folder is removed on any error, on Ctrl-C, and on SIGTERM (the process then dies by the signal,
as it would have without kiln), unless something else already handles SIGTERM.

    check_out_dir(out, overwrite)        # refuses a file, or a folder that holds a model/tokenizer/run
    with staged_dir(out) as tmp:         # write into tmp; on success its files replace out's
        model.save_pretrained(tmp)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import KilnError
from kiln.hub.files import fsync_dir

# What a folder holds, told by the files in it (glob -> what it is).
_KINDS: tuple[tuple[str, str], ...] = (
    ("config.json", "a model"), ("*.safetensors", "a model"), ("pytorch_model*.bin", "a model"),
    ("adapter_config.json", "a model"),
    ("tokenizer.json", "a tokenizer"), ("vocab.txt", "a tokenizer"), ("tokenizer_config.json", "a tokenizer"),
    ("metrics.jsonl", "a training run"), ("run_state.json", "a training run"), ("ckpt-*", "a training run"),
    ("manifest.json", "token shards or a checkpoint"), ("*.npy", "token shards"),
)
# Weight files of an HF directory: a new export replaces all of them, so none of an old one lingers.
_WEIGHTS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
            "adapter_model.*", "adapter_config.json")


def holdings(folder: str | os.PathLike) -> dict[str, list[str]]:
    """{what: [file names]} of the models, tokenizers, runs and shards in `folder` ({} if none or absent)."""
    folder = Path(folder)
    found: dict[str, list[str]] = {}
    if not folder.is_dir():
        return found
    for pattern, kind in _KINDS:
        for p in sorted(folder.glob(pattern)):
            names = found.setdefault(kind, [])
            if p.name not in names:
                names.append(p.name)
    return found


def describe(found: dict[str, list[str]]) -> str:
    return "; ".join(f"{kind} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                     for kind, names in found.items())


def check_out_dir(out: str | os.PathLike, overwrite: bool, flag: str = "--out") -> None:
    """Refuse `out` when it is a file, or a folder holding a model, tokenizer, run or shards (unless `overwrite`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KilnError(f"{flag} {out}: is a file, not a directory; choose a directory to write to")
    found = holdings(out)
    if found and not overwrite:
        raise KilnError(f"{flag} {out}: already holds {describe(found)}; pass --overwrite to replace it, "
                        "or choose another directory")


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder beside `out` to write into. On success its files move into `out` (a new or empty
    `out` is one rename; otherwise each file is replaced atomically and old weight files the new ones
    do not include are removed); on any error it is deleted and `out` is untouched."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.kiln-tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        with _sigterm_raises():
            yield tmp
            _publish(tmp, out)
    except _Terminated:
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die by the signal, as an uncaught SIGTERM does
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Terminated(BaseException):
    """SIGTERM arrived while a staging folder existed."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Inside: SIGTERM raises _Terminated (so the staging folder goes, as on Ctrl-C), where its action is the
    default one and this is the main thread; a handler someone else installed (a trainer's stop) is left be."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _publish(tmp: Path, out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return
    new = {p.name for p in tmp.iterdir()}
    for pattern in _WEIGHTS:
        for stale in out.glob(pattern):
            if stale.name not in new and stale.is_file():
                stale.unlink()
    for p in sorted(tmp.iterdir()):
        target = out / p.name
        if p.is_dir() and target.exists():
            shutil.rmtree(target)
        os.replace(p, target)
    tmp.rmdir()
    fsync_dir(out)
