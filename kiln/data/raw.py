"""Raw token ids as pre-training data: a flat .npy / .bin / .txt file, or a folder of such shards without a manifest.

A .txt file holds whitespace-separated integer ids (the seed research trainer's token files); it is read
whole into memory, and a token that is not a non-negative integer is named by file:line.

`RawTokens` offers what `Windows` reads from a `ShardSet` (lengths, dtype, eos_id, tokens(i), check_ids), so
raw ids stream exactly as `kiln tokenize` output does: the same windows, the same resumable cursor. Every id is
checked against the model's vocabulary once, when the data is opened, and nothing is written beside the files.
`val_fraction` holds out the tail of a flat file, or whole shards at the end of a folder.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.shards import MANIFEST, ShardError
from kiln.hub.files import check_readable, folder_files

# token id dtypes kiln reads; float, bool and 8-bit arrays are not token ids
ID_DTYPES = ("uint16", "int32", "uint32", "int64")
RAW_SUFFIXES = (".npy", ".bin", ".txt")
_CHUNK = 1 << 22  # ids scanned at a time by the vocabulary check


def raw_files(path: str | os.PathLike, extension: str = ".bin") -> list[Path] | None:
    """The token files `path` names: itself when a .npy/.bin file, or a manifest-less folder's files ending with
    `extension` (sorted); None when `path` is neither (a shard directory, records, ...)."""
    path = Path(path)
    if path.suffix.lower() in RAW_SUFFIXES and not path.is_dir():  # named explicitly: read or refused
        return [check_readable(path, "token file")] if path.exists() or path.is_symlink() else None
    if not path.is_dir() or (path / MANIFEST).exists():
        return None
    found = folder_files(path, lambda p: p.name.endswith(extension), what="token file")
    return found or None


_TEXT: dict[tuple[str, int, int], np.ndarray] = {}  # parsed token text files, by (path, mtime, size): parsed once


def _text_ids(path: Path) -> np.ndarray:
    """The whitespace-separated integer ids of a token text file (int64, read-only); a bad token by file:line."""
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _TEXT:
        _TEXT[key] = _parse_text(path)
    return _TEXT[key]


def _parse_text(path: Path) -> np.ndarray:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: cannot read the token text file ({e})") from None
    try:
        ids = np.array(text.split(), dtype=np.int64)
    except (ValueError, OverflowError):
        ids = None
    if ids is None or (len(ids) and ids.min() < 0):  # find the first offender's line (the slow path, once)
        for n, line in enumerate(text.splitlines(), 1):
            for token in line.split():
                if not (token.isascii() and token.isdigit()) or int(token) >= 2 ** 63:
                    raise ShardError(f"{path}:{n}: {token!r} is not a token id (token text files hold "
                                     "whitespace-separated non-negative integers)")
        ids = np.array([int(t) for t in text.split()], dtype=np.int64)  # numpy refused a spelling int() takes
    if len(ids) == 0:
        raise ShardError(f"{path}: the token text file holds no token ids")
    ids.flags.writeable = False
    return ids


def max_id(files: list[Path], dtype: str | None) -> int:
    """The largest token id in `files` (a from-scratch model's vocabulary is this + 1)."""
    top = -1
    for f in files:
        ids = _open(f, dtype)
        for start in range(0, len(ids), _CHUNK):
            top = max(top, int(np.asarray(ids[start:start + _CHUNK]).max()))
    return top


def _open(path: Path, dtype: str | None) -> np.ndarray:
    """A read-only 1-D memmap (an in-memory array for .txt) of a token file; odd dtypes and shapes refused by name."""
    if path.suffix.lower() == ".txt":
        return _text_ids(path)
    if path.suffix.lower() == ".npy":
        try:
            ids = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ShardError(f"{path}: not a readable .npy file ({e})") from None
        if ids.ndim != 1:
            raise ShardError(f"{path}: holds an array of shape {list(ids.shape)}; raw token files are flat (1-D)")
    else:
        if dtype is None:
            raise ShardError(f"{path}: a .bin file has no header; set data.dtype to one of {', '.join(ID_DTYPES)}")
        size, item = path.stat().st_size, np.dtype(dtype).itemsize
        if size % item:
            raise ShardError(f"{path}: {size} bytes is not a whole number of {dtype} ids ({item} bytes each)")
        if size == 0:
            raise ShardError(f"{path}: empty token file")
        ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if ids.dtype.name not in ID_DTYPES:
        raise ShardError(f"{path}: token ids of dtype {ids.dtype.name} are not read; use one of "
                         f"{', '.join(ID_DTYPES)}")
    return ids


def _check_vocab(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    for start in range(0, len(ids), _CHUNK):
        chunk = np.asarray(ids[start:start + _CHUNK])
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            at = start + int(np.argmax(bad))
            raise ShardError(f"{path}: token id {int(ids[at])} at position {at} is outside the model's vocabulary "
                             f"(0..{vocab_size - 1}); set model.config.vocab_size higher or fix the file")


class RawTokens:
    """One split ("train" or "val") of raw token files, read as `Windows` reads a ShardSet."""

    def __init__(self, files: list[Path], split: str, vocab_size: int, eos_id: int, dtype: str | None = None,
                 val_fraction: float = 0.0):
        self.root = files[0] if len(files) == 1 else files[0].parent
        self.split, self.vocab_size, self.eos_id = split, vocab_size, eos_id
        arrays = [_open(f, dtype) for f in files]
        dtypes = {a.dtype.name for a in arrays}
        if len(dtypes) > 1:
            raise ShardError(f"{self.root}: the token files mix dtypes ({', '.join(sorted(dtypes))}); use one")
        self.dtype = arrays[0].dtype
        for f, a in zip(files, arrays):
            if len(a) == 0:
                raise ShardError(f"{f}: empty token file")
            _check_vocab(f, a, vocab_size)
        # (file, first id, end id) per piece of this split
        self.pieces: list[tuple[Path, int, int]] = [(f, 0, len(a)) for f, a in zip(files, arrays)]
        if val_fraction > 0:
            self.pieces = self._split(self.pieces, val_fraction, split)
        elif split != "train":
            raise ShardError(f"{self.root}: raw token data has no {split!r} split; set data.val_fraction")
        self.paths = [p for p, _, _ in self.pieces]
        self.lengths = np.array([end - lo for _, lo, end in self.pieces], dtype=np.int64)
        self._dtype_arg = dtype
        self._maps: dict[int, np.ndarray] = {}  # piece -> its memmap, opened on first use in this process

    def _split(self, pieces: list[tuple[Path, int, int]], fraction: float, split: str) -> list[tuple[Path, int, int]]:
        if len(pieces) == 1:  # the tail of one flat file
            path, _, n = pieces[0]
            cut = n - max(2, math.ceil(n * fraction))
            if cut < 2:
                raise ShardError(f"{path}: {n} ids are too few to hold out data.val_fraction = {fraction}")
            return [(path, 0, cut)] if split == "train" else [(path, cut, n)]
        held = max(1, round(len(pieces) * fraction))  # whole shards at the end of the folder
        if held >= len(pieces):
            raise ShardError(f"{self.root}: data.val_fraction = {fraction} would hold out all {len(pieces)} shards")
        return pieces[:-held] if split == "train" else pieces[-held:]

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def tokens(self, i: int) -> np.ndarray:
        """Piece i as a read-only memmap slice, opened once per process."""
        m = self._maps.get(i)
        if m is None:
            path, lo, end = self.pieces[i]
            m = self._maps[i] = _open(path, self._dtype_arg)[lo:end]
        return m

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data for a resume: each piece's file, range and size (no hash: files may be large)."""
        return {"raw": [[str(p), lo, end, p.stat().st_size, p.stat().st_mtime_ns] for p, lo, end in self.pieces]}

    def raise_if_corrupt(self) -> None:
        """Ids were checked against the vocabulary when opened."""

    def check_ids(self, tokens: np.ndarray) -> None:
        """Every id was checked when the files were opened; nothing is left to check per batch."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}
