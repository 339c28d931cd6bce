"""Token shards on disk: .npy files of token ids plus one manifest.json, written atomically.

    OUT/manifest.json        format, dtype, eos_id, tokenizer digest, per split: shard files with
                             token and document counts, byte sizes and sha256
    OUT/train-00000.npy      1-D uint16 (vocab <= 65536) or uint32 token ids; every document is
    OUT/val-00000.npy        followed by eos_id, so document boundaries are the EOS positions

Any numpy reads a shard: `np.load(path, mmap_mode="r")`. Shards end on document boundaries.
Opening a split checks every shard's header and size against the manifest (cheap); `verify`
also checks the sha256 (reads everything), and `start_verify` does that at once for a small split or
on a background thread for a large one, reported by the next `raise_if_corrupt()`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.hub.files import (
    file_sha256,
    fsync_dir,
    why_unreadable,
    write_atomic,
    write_text_atomic,
)
from kiln.hub.jsonio import read_json

FORMAT = "kiln-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES: dict[str, type[np.unsignedinteger[Any]]] = {"uint16": np.uint16, "uint32": np.uint32}


class ShardError(KilnError):
    """A shard directory, manifest or shard file that cannot be used as it is."""


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> str:
    """The narrowest dtype holding every id below `vocab_size`, or `requested` if it does."""
    if requested == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise ShardError(f"dtype {requested!r} is not one of auto, uint16, uint32")
    limit = np.iinfo(DTYPES[requested]).max + 1
    if vocab_size > limit:
        raise ShardError(f"the tokenizer's vocabulary has {vocab_size} ids but {requested} holds only {limit} "
                         "(ids 0.." f"{limit - 1}); use uint32 or dtype auto")
    return requested


def tokenizer_digest(tokenizer_json: str) -> str:
    """sha256 of a tokenizer's canonical JSON: the same tokenizer gives the same digest however it was saved."""
    canonical = json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def write_shard(path: Path, tokens: np.ndarray) -> dict[str, Any]:
    """Write one .npy shard atomically (temp, fsync, rename); its manifest entry."""
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # through a file: np.save on a path would append ".npy" to the temp name
            np.save(f, np.ascontiguousarray(tokens), allow_pickle=False)

    write_atomic(path, save)
    return {"file": path.name, "tokens": int(tokens.size), "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    """manifest.json, written last: a directory without one is an unfinished tokenize run."""
    path = out_dir / MANIFEST
    write_text_atomic(path, json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1, sort_keys=True)
                      + "\n")
    fsync_dir(out_dir)
    return path


@dataclass
class ShardWriter:
    """Collects one split's documents (each already ending in EOS) and cuts shards on document boundaries."""
    out_dir: Path
    split: str
    dtype: str
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _parts: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0
    _docs: int = 0

    def add(self, doc: np.ndarray) -> None:
        self._parts.append(doc.astype(DTYPES[self.dtype], copy=False))
        self._buffered += doc.size
        self._docs += 1
        if self._buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._parts:
            return
        path = self.out_dir / f"{self.split}-{len(self.shards):05d}.npy"
        entry = write_shard(path, np.concatenate(self._parts))
        entry["documents"] = self._docs
        self.shards.append(entry)
        self._parts, self._buffered, self._docs = [], 0, 0

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {"tokens": sum(s["tokens"] for s in self.shards), "documents": sum(s["documents"] for s in self.shards),
                "shards": self.shards}


# ---- reading --------------------------------------------------------------------------------
def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a shard directory, with its required keys checked."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise ShardError(f"{root}: no such token shard directory")
    if not path.is_file():
        raise ShardError(f"{root}: no {MANIFEST}; not a `kiln tokenize` output, or that run did not finish")
    manifest = read_json(path, error=ShardError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: not a kiln token shard manifest (format must be {FORMAT!r})")
    for key in ("version", "dtype", "vocab_size", "eos_id", "tokenizer", "splits"):
        if key not in manifest:
            raise ShardError(f"{path}: missing key {key!r}")
    if manifest["version"] > VERSION:
        raise ShardError(f"{path}: format version {manifest['version']} is newer than this kiln reads ({VERSION})")
    if manifest["dtype"] not in DTYPES:
        raise ShardError(f"{path}: dtype {manifest['dtype']!r} is not one of {', '.join(DTYPES)}")
    limit = np.iinfo(DTYPES[manifest["dtype"]]).max + 1
    if manifest["vocab_size"] > limit:
        raise ShardError(f"{path}: vocab_size {manifest['vocab_size']} does not fit dtype {manifest['dtype']} "
                         f"(at most {limit} ids)")
    return manifest


def check_tokenizer(root: str | os.PathLike, manifest: dict[str, Any], digest: str, source: str) -> None:
    """Refuse shards made by another tokenizer than the run's: the ids would mean other tokens."""
    made = manifest["tokenizer"]
    if made.get("sha256") != digest:
        raise ShardError(f"{Path(root) / MANIFEST}: the shards were tokenized with {made.get('source', '?')} "
                         f"(sha256 {str(made.get('sha256'))[:12]}, vocab {made.get('vocab_size')}), not with the "
                         f"run's tokenizer {source} (sha256 {digest[:12]}); re-run `kiln tokenize` with it")


class ShardSet:
    """One split of a shard directory: its shard lengths, opened lazily as read-only memmaps."""

    def __init__(self, root: str | os.PathLike, split: str):
        self.root = Path(root)
        self.split = split
        self.manifest = read_manifest(self.root)
        splits = self.manifest["splits"]
        if split not in splits or not splits[split]["shards"]:
            have = ", ".join(s for s in splits if splits[s]["shards"]) or "none"
            raise ShardError(f"{self.root / MANIFEST}: no shards in split {split!r} (splits with shards: {have})")
        self.entries = splits[split]["shards"]
        self.dtype = np.dtype(DTYPES[self.manifest["dtype"]])
        self.eos_id = int(self.manifest["eos_id"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.lengths = np.array([e["tokens"] for e in self.entries], dtype=np.int64)
        self.paths = [self.root / e["file"] for e in self.entries]
        self._maps: dict[int, np.ndarray] = {}
        self._problem: str | None = None  # what a background sha256 check found
        for i in range(len(self.paths)):
            self._check(i)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def _check(self, i: int) -> None:
        path, entry = self.paths[i], self.entries[i]
        why = why_unreadable(path)
        if why is not None:
            raise ShardError(f"{path}: shard listed in {MANIFEST} "
                             f"{'is missing' if why == 'does not exist' else why}")
        size = path.stat().st_size
        if size == 0 or entry["tokens"] == 0:
            raise ShardError(f"{path}: empty shard (0 {'bytes' if size == 0 else 'tokens'})")
        try:
            with open(path, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)  # the header only; no data is read
                offset = f.tell()
        except ValueError as e:
            raise ShardError(f"{path}: not a .npy token shard ({e})") from None
        if dtype != self.dtype or len(shape) != 1 or shape[0] != entry["tokens"]:
            raise ShardError(f"{path}: header says {dtype}{list(shape)}, the manifest {self.dtype}[{entry['tokens']}]")
        expected = offset + entry["tokens"] * self.dtype.itemsize
        if size != expected or size != entry.get("bytes", size):
            raise ShardError(f"{path}: truncated or altered: {size} bytes, expected {expected} "
                             f"({entry['tokens']} tokens of {self.dtype})")

    def tokens(self, i: int) -> np.ndarray:
        """Shard i as a read-only memmap, opened once per process."""
        m = self._maps.get(i)
        if m is None:
            m = self._maps[i] = np.load(self.paths[i], mmap_mode="r")
        return m

    def verify(self) -> None:
        """Check every shard's sha256 against the manifest (reads all the data)."""
        for path, entry in zip(self.paths, self.entries):
            if file_sha256(path) != entry["sha256"]:
                raise ShardError(f"{path}: contents do not match the sha256 in {MANIFEST}")

    def start_verify(self, inline_bytes: int = 1 << 28) -> None:
        """Check the sha256 of every shard once: now when the split is under `inline_bytes`, else on a
        daemon thread whose finding `raise_if_corrupt()` raises (the training loop polls it)."""
        if sum(int(e.get("bytes", 0)) for e in self.entries) <= inline_bytes:
            self.verify()
            return

        def work() -> None:
            try:
                self.verify()
            except (ShardError, OSError) as e:
                self._problem = str(e)

        threading.Thread(target=work, name="kiln-shard-sha256", daemon=True).start()

    def raise_if_corrupt(self) -> None:
        if self._problem is not None:
            raise ShardError(self._problem)

    def check_ids(self, tokens: np.ndarray) -> None:
        """Refuse token ids past the manifest's vocabulary (altered shards), naming the shard that changed."""
        self.raise_if_corrupt()
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            self.verify()  # names the altered file, if its checksum shows it
            raise ShardError(f"{self.root}: split {self.split!r} holds token id {int(tokens.max())}, past the "
                             f"vocabulary of {self.vocab_size} in {MANIFEST}; the shards were altered after "
                             "`kiln tokenize` wrote them")

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the lengths and paths; each opens its own memmaps.
        return {**self.__dict__, "_maps": {}}
