"""Rows in: JSONL and CSV files read into dicts, each remembering the file:line it came from; HF datasets
sources (a save_to_disk folder, parquet, arrow, a JSON array) through kiln.data.hfdata, as file:row N.

Errors name the file and line (a JSONL line that is not JSON, a row missing a field), so a user
can open the file at the spot.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.hfdata import is_hf_source, iter_rows
from kiln.errors import KilnError
from kiln.hub.files import why_unreadable
from kiln.hub.jsonio import iter_jsonl


@dataclass(frozen=True)
class Record:
    fields: dict[str, Any]
    where: str  # "path:line", for messages

    def get(self, key: str) -> Any:
        if key not in self.fields:
            have = ", ".join(sorted(self.fields)) or "none"
            raise KilnError(f"{self.where}: no field {key!r} (fields here: {have})")
        return self.fields[key]


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    if is_hf_source(path):
        return "datasets"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
    raise KilnError(f"{path}: cannot tell the format from the extension {suffix!r}; use .jsonl, .csv, .parquet, "
                    ".arrow, .json or a datasets save_to_disk folder, or set data.format")


def read_records(path: str | os.PathLike, fmt: str = "auto") -> list[Record]:
    """All rows of a JSONL or CSV file, or of an HF datasets source. Blank JSONL lines are skipped."""
    path = Path(path)
    if not (path.is_dir() and fmt in ("auto", "datasets")):
        why = why_unreadable(path)
        if why is not None:
            raise KilnError(f"{path}: data file {'not found' if why == 'does not exist' else why}")
    fmt = detect_format(path, fmt)
    records: list[Record] = []
    if fmt == "datasets":
        records = [Record(row, where) for where, row in iter_rows(path)]
    elif fmt == "jsonl":
        records = [Record(row, f"{path}:{no}") for no, row, _ in iter_jsonl(path)]
    else:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a BOM (Excel's "CSV UTF-8") is not part of the first header
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            try:
                if not reader.fieldnames:
                    raise KilnError(f"{path}: empty CSV (no header row)")
                for row in reader:
                    # DictReader's line_num is the physical line just read (rows may span lines).
                    if None in row:
                        raise KilnError(f"{path}:{reader.line_num}: more values than header columns")
                    records.append(Record(dict(row), f"{path}:{reader.line_num}"))
            except UnicodeDecodeError as e:  # decoded in blocks, so the reader's line is not the bad one
                raise KilnError(f"{_first_bad_line(path)}: not valid UTF-8 ({e.reason}); re-encode the file as "
                                "UTF-8") from None
    if not records:
        raise KilnError(f"{path}: no rows")
    return records


def _first_bad_line(path: Path) -> str:
    """`path:line` of the first line that is not UTF-8, with the byte's column (for the message)."""
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path}:{no} (byte {e.start + 1} of the line)"
    return str(path)
