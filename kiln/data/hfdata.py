"""HF `datasets` sources: a `save_to_disk` folder, or a local parquet / arrow / JSON file, read as rows.

Fine-tuning, SFT (kiln.data.records) and `kiln tokenize` (kiln.data.tokenize) take them beside their own
formats; each row becomes a dict with the dataset's column names, placed as `file:row N` in messages.
`datasets` is an optional extra (pip install 'kiln[datasets]'), imported only when such a source is read.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.hub.files import file_sha256, folder_files

TABLE_FILES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}


def _starts_with_array(path: Path) -> bool:
    """A .json file holding one JSON array (JSONL, one object a line, stays with kiln's own line-exact reader)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def is_hf_source(path: str | os.PathLike) -> bool:
    """A `save_to_disk` folder (a Dataset's state.json, or a DatasetDict's dataset_dict.json), a parquet or
    arrow file, or a .json file holding an array."""
    path = Path(path)
    if path.is_dir():
        return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    suffix = path.suffix.lower()
    if suffix == ".json":
        return path.is_file() and _starts_with_array(path)
    return path.is_file() and suffix in (".parquet", ".arrow")


def _datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise KilnError(f"{path}: reading a datasets folder, parquet, arrow or JSON-array file needs the datasets "
                        "package; pip install 'kiln[datasets]'") from None
    return datasets


def load_dataset_rows(path: str | os.PathLike) -> Any:
    """The `datasets.Dataset` at `path` (a save_to_disk folder, or a parquet / arrow / JSON file)."""
    path = Path(path)
    if not path.exists():
        raise KilnError(f"{path}: data file not found")
    ds_lib = _datasets(path)
    ds_lib.disable_progress_bars()  # a small file's "Generating train split" bar is noise in kiln's output
    try:
        if path.is_dir():
            if (path / "dataset_dict.json").is_file():
                splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
                pick = "train" if "train" in splits or not splits else splits[0]
                raise KilnError(f"{path}: a DatasetDict with splits {', '.join(splits) or 'none'}; name one "
                                f"folder, e.g. {path / pick}")
            ds = ds_lib.load_from_disk(str(path))
        else:
            # held in memory, its build cache in a temporary folder: nothing left in ~/.cache or beside the file
            with tempfile.TemporaryDirectory(prefix="kiln-datasets-") as cache:
                ds = ds_lib.load_dataset(TABLE_FILES[path.suffix.lower()], data_files=str(path), split="train",
                                         keep_in_memory=True, cache_dir=cache)
    except KilnError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many kinds for an unreadable file
        raise KilnError(f"{path}: cannot be read with datasets ({type(e).__name__}: {e})") from None
    return ds


def source_sha256(path: str | os.PathLike) -> str:
    """A data source's identity for a run's fingerprint: a file's sha256, or for a folder the sha256 over its
    files' relative names and hashes (so a resume notices changed data either way)."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in folder_files(path, lambda p: True, recursive=True, what="dataset file"):
        h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def iter_rows(path: str | os.PathLike, need: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`file:row N`, row) for every row; `need`: a column that must exist (else an error naming file and column)."""
    ds = load_dataset_rows(path)
    if need is not None and need not in ds.column_names:
        raise KilnError(f"{path}: no column {need!r} (columns: {', '.join(ds.column_names)})")
    # ClassLabel columns hold ints; rows carry their names, as a JSONL or CSV file of the same data would
    names = {k: f.names for k, f in ds.features.items() if isinstance(f, _datasets(Path(path)).ClassLabel)}
    for i, row in enumerate(ds, 1):
        for k, label_names in names.items():
            if row[k] is not None and 0 <= row[k] < len(label_names):
                row[k] = label_names[row[k]]
        yield f"{path}:row {i}", row
