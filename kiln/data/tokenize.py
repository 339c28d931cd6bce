"""Text in, token shards out: what `kiln tokenize` runs.

Inputs are text files (one document per file), JSONL (one document per line, in a text field),
parquet / arrow files (a text column) and HF datasets save_to_disk folders or JSON-array files (read
through kiln.data.hfdata); directories are walked for those suffixes, in sorted
order. Documents are read in the main process and tokenized in batches by worker processes;
results are taken back in submission order, so the shards are the same for any worker count.
A document goes to the validation split when a hash of (seed, its index) says so: the split is
by whole documents, reproducible, and independent of batching.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln.data.hfdata import is_hf_source, iter_rows
from kiln.data.shards import MANIFEST, ShardError, ShardWriter, dtype_for_vocab, tokenizer_digest, write_manifest
from kiln.errors import KilnError
from kiln.hub.files import check_readable, folder_files
from kiln.hub.jsonio import iter_jsonl

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
ENCODING_HINT = "fix the file or pass --encoding-errors replace"


@dataclass(frozen=True)
class Doc:
    text: str
    where: str        # "file", "file:line" or "file:row N", for messages
    progress: int     # input bytes this document accounts for (the progress bar's unit)


def input_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files named, with directories expanded (recursively, sorted) to the readable suffixes."""
    out: list[Path] = []
    known = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES
    for p in map(Path, paths):
        if is_hf_source(p):  # a datasets save_to_disk folder or a JSON array: read whole by kiln.data.hfdata
            out.append(p)
        elif p.is_dir():
            found = folder_files(p, lambda f: f.suffix.lower() in known, recursive=True, what="document file")
            if not found:
                raise KilnError(f"{p}: no {', '.join(known)} files in this directory")
            out += found
        elif p.is_file() or p.is_symlink():
            check_readable(p, "document file")
            if p.suffix.lower() not in known:
                raise KilnError(f"{p}: cannot tell the format from the extension {p.suffix!r}; use one of "
                                f"{', '.join(known)}")
            out.append(p)
        else:
            raise KilnError(f"{p}: no such file or directory")
    return out


def _decode(raw: bytes, where: str, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise KilnError(f"{where}: not UTF-8 at byte {e.start} ({e.reason}); {ENCODING_HINT}") from None


def _jsonl_docs(path: Path, field: str, errors: str) -> Iterator[Doc]:
    for no, row, size in iter_jsonl(path, encoding_errors=errors, hint=ENCODING_HINT):
        where = f"{path}:{no}"
        if field not in row:
            raise KilnError(f"{where}: no field {field!r} (fields here: {', '.join(sorted(row)) or 'none'}); "
                            "set --text-field")
        if not isinstance(row[field], str):
            raise KilnError(f"{where}: field {field!r} is {type(row[field]).__name__}, not a string")
        yield Doc(row[field], where, size)


def _table_docs(path: Path, field: str) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            pf = pq.ParquetFile(path)
            schema, total = pf.schema_arrow, pf.metadata.num_rows
            batches = pf.iter_batches(columns=[field]) if field in schema.names else iter(())
        else:
            source = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_file(source)  # Arrow IPC file (feather v2)
                schema, total = reader.schema, sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()  # Arrow IPC stream (what HF datasets writes)
                schema, total, batches = table.schema, table.num_rows, iter(table.to_batches())
    except (pa.ArrowException, OSError) as e:
        raise KilnError(f"{path}: cannot be read as {path.suffix.lstrip('.')} ({e})") from None
    if field not in schema.names:
        raise KilnError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}); set --text-field")
    size, row = path.stat().st_size, 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        share = size * batch.num_rows // max(total, 1)
        for i, value in enumerate(column.to_pylist()):
            if not isinstance(value, str):
                raise KilnError(f"{path}:row {row + 1}: column {field!r} is "
                                f"{'null' if value is None else type(value).__name__}, not a string")
            row += 1
            yield Doc(value, f"{path}:row {row}", share if i == 0 else 0)


def _dataset_docs(path: Path, field: str) -> Iterator[Doc]:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    for i, (where, row) in enumerate(iter_rows(path, need=field)):
        if not isinstance(row[field], str):
            raise KilnError(f"{where}: column {field!r} is {type(row[field]).__name__}, not a string")
        yield Doc(row[field], where, size if i == 0 else 0)


def read_documents(files: list[Path], text_field: str = "text", errors: str = "strict") -> Iterator[Doc]:
    """Every document of every file, in order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix not in TABLE_SUFFIXES and is_hf_source(path):
            yield from _dataset_docs(path, text_field)
        elif suffix in TEXT_SUFFIXES:
            raw = path.read_bytes()
            yield Doc(_decode(raw, str(path), errors), str(path), len(raw))
        elif suffix in JSONL_SUFFIXES:
            yield from _jsonl_docs(path, text_field, errors)
        else:
            yield from _table_docs(path, text_field)


def in_validation(index: int, fraction: float, seed: int) -> bool:
    """Whether document `index` belongs to the validation split (a stable hash, not an RNG stream)."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0 ** 64 < fraction


# ---- the tokenizer, once per worker process -------------------------------------------------
_WORKER_TOKENIZER: Tokenizer | None = None


def _load_backend(tokenizer_json: str) -> Tokenizer:
    from tokenizers import Tokenizer as _HF

    return _HF.from_str(tokenizer_json)


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = _load_backend(tokenizer_json)


def _encode_batch(texts: list[str], backend: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(all ids concatenated as int64, per-document lengths); no special tokens: EOS is added by the caller."""
    backend = backend or _WORKER_TOKENIZER
    assert backend is not None, "a worker encodes with the tokenizer _init_worker loaded"
    encs = backend.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    ids = np.fromiter((i for e in encs for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
    return ids, lengths


def _batches(docs: Iterator[Doc], size: int) -> Iterator[list[Doc]]:
    batch: list[Doc] = []
    for d in docs:
        batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True)
class TokenizeOptions:
    text_field: str = "text"
    val_fraction: float = 0.0
    seed: int = 0
    shard_tokens: int = 1 << 24
    workers: int = 1
    dtype: str = "auto"
    eos: str | None = None             # a token text; default: the tokenizer's eos_token
    encoding_errors: str = "strict"    # or "replace"
    batch_docs: int = 256
    overwrite: bool = False
    progress: bool = True


def _prepare_out(out_dir: Path, overwrite: bool) -> None:
    old = sorted(out_dir.glob("*.npy")) + ([out_dir / MANIFEST] if (out_dir / MANIFEST).exists() else [])
    if old and not overwrite:
        raise KilnError(f"{out_dir}: already holds token shards ({old[0].name}, ...); pass --overwrite to replace them")
    for p in old:
        p.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def tokenize_to_shards(inputs: Sequence[str | os.PathLike[str]], tokenizer: str | os.PathLike, out_dir: str | os.PathLike,
                       options: TokenizeOptions = TokenizeOptions()) -> dict:
    """Tokenize `inputs` with `tokenizer` (an HF directory or a tokenizer.json) into shards; the manifest."""
    from kiln.hub import Tokenizer

    o = options
    if not 0.0 <= o.val_fraction < 1.0:
        raise KilnError(f"--val-fraction must be within [0, 1), got {o.val_fraction}")
    if o.shard_tokens < 1 or o.workers < 1:
        raise KilnError("--shard-tokens and --workers must be >= 1")
    files = input_files(list(inputs))  # every input read or refused before the tokenizer loads
    tok_path = Path(tokenizer)
    tok = Tokenizer.from_dir(tok_path) if tok_path.is_dir() else Tokenizer(_load_from_file(tok_path))
    eos_text = o.eos or tok.specials.get("eos_token")
    if eos_text is None:
        raise KilnError(f"{tok_path}: the tokenizer names no eos_token; pass --eos with the token that ends a document")
    eos_id = tok.backend.token_to_id(eos_text)
    if eos_id is None:
        raise KilnError(f"{tok_path}: the end-of-document token {eos_text!r} is not in the vocabulary")
    vocab = tok.vocab_size
    dtype = dtype_for_vocab(vocab, o.dtype)
    out = Path(out_dir)
    _prepare_out(out, o.overwrite)
    tokenizer_json = tok.backend.to_str()
    writers = {s: ShardWriter(out, s, dtype, o.shard_tokens) for s in ("train", "val")}
    bar = _Progress(sum(f.stat().st_size for f in files), o.progress)
    index, max_id = 0, -1
    try:
        for batch, (ids, lengths) in _pipeline(_batches(read_documents(files, o.text_field, o.encoding_errors),
                                                        o.batch_docs), tokenizer_json, o.workers):
            if ids.size:
                max_id = max(max_id, int(ids.max()))
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for d in range(len(batch)):
                split = "val" if in_validation(index, o.val_fraction, o.seed) else "train"
                writers[split].add(np.append(ids[starts[d]:starts[d + 1]], eos_id))
                index += 1
            bar.advance(sum(d.progress for d in batch), index, sum(w._buffered for w in writers.values()) +
                        sum(s["tokens"] for w in writers.values() for s in w.shards))
    finally:
        bar.close()
    if index == 0:
        raise KilnError(f"no documents in {', '.join(map(str, inputs))}")
    assert max_id < vocab, "the tokenizer returned an id outside its own vocabulary"
    splits = {s: w.summary() for s, w in writers.items()}
    if o.val_fraction > 0 and not splits["val"]["shards"]:
        raise ShardError(f"no document of {index} fell into the validation split at --val-fraction {o.val_fraction}; "
                         "raise it (or set it to 0 for no validation split)")
    manifest = {"dtype": dtype, "vocab_size": vocab, "eos_id": eos_id, "eos_token": eos_text,
                "tokenizer": {"source": str(tok_path), "sha256": tokenizer_digest(tokenizer_json),
                              "vocab_size": vocab},
                "splits": splits, "documents": index, "val_fraction": o.val_fraction, "seed": o.seed,
                "text_field": o.text_field, "sources": [str(f) for f in files]}
    tok.save(out / "tokenizer")  # the shards carry the tokenizer that made them
    write_manifest(out, manifest)
    return manifest


def _load_from_file(path: Path):
    if not path.is_file():
        raise KilnError(f"{path}: no such tokenizer directory or tokenizer.json")
    try:
        return _load_backend(path.read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001 - the Rust library reports parse errors as plain Exceptions
        raise KilnError(f"{path}: cannot be read by the tokenizers library ({e})") from None


def _pipeline(batches: Iterator[list[Doc]], tokenizer_json: str, workers: int):
    """(batch, encoded) in input order; with workers > 1 a bounded number of batches is in flight."""
    if workers == 1:
        backend = _load_backend(tokenizer_json)
        for batch in batches:
            yield batch, _encode_batch([d.text for d in batch], backend)
        return
    # fork: workers need no importable __main__ (stdin, notebooks). The parent never ran the
    # tokenizer's thread pool (only load/to_str), so no Rust threads are copied mid-flight.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_encode_batch, ([d.text for d in batch],))))
            if len(pending) >= 2 * workers:  # bounded: reading never runs far ahead of tokenizing
                b, r = pending.popleft()
                yield b, r.get()
        while pending:
            b, r = pending.popleft()
            yield b, r.get()


class _Progress:
    """A rich bar over input bytes, with documents and tokens so far."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(),
                              TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.p.add_task("tokenize", total=total, info="")
            self.p.start()

    def advance(self, nbytes: int, docs: int, tokens: int) -> None:
        if self.enabled:
            self.p.update(self.task, advance=nbytes, info=f"{docs:,} docs, {tokens:,} tokens")

    def close(self) -> None:
        if self.enabled:
            self.p.stop()

