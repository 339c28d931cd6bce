"""The verify matrix: every family x head, built tiny by transformers, exported by kiln, verified."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.hub.jsonio import read_json
from kiln.interop.export import export_model
from kiln.interop.tiny import make_tiny, missing_tiny_message
from kiln.interop.verify import verify_export
from kiln.models.auto import REGISTRY


@dataclass
class Cell:
    family: str
    head: str
    ok: bool
    max_diff: float | None
    detail: str


def default_cells() -> list[tuple[str, str, str | None]]:
    """(model_type, head, None) for every registered family and every head it has.

    A family without a tiny config is listed too: its cells fail (see `missing_tiny`), so a new
    family cannot drop out of the grid unnoticed.
    """
    return [(model_type, head, None) for model_type, family in REGISTRY.items() for head in family.tasks]


def missing_tiny(model_type: str) -> str | None:
    """Why registered `model_type` cannot be built tiny (its Family declares no `tiny`), or None."""
    return missing_tiny_message(model_type) if REGISTRY[model_type].tiny is None else None


def read_cells(path: str) -> list[tuple[str, str, str | None]]:
    """A JSON list of {"family", "head", "path"} naming real directories to verify."""
    items = read_json(path, want=list)
    cells = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not {"family", "head", "path"} <= item.keys():
            raise KilnError(f"{path}: item {i} must be an object with family, head and path")
        cells.append((item["family"], item["head"], item["path"]))
    return cells


def run_cell(model_type: str, head: str, src: str | None, work: Path, device: str = "cpu") -> Cell:
    if src is None and (why := missing_tiny(model_type)):
        return Cell(model_type, head, False, None, why)
    try:
        if src is None:
            src = str(make_tiny(model_type, head, work / f"{model_type}-{head}-src"))
        out = export_model(src, work / f"{model_type}-{head}-export", head=head)
        checks = verify_export(out, source=src, device=device)
    except Exception as e:  # noqa: BLE001 - keep going past any failure; the grid shows it
        return Cell(model_type, head, False, None, f"{type(e).__name__}: {e}")
    diffs = [float(c.detail.rsplit("max abs diff ", 1)[1]) for c in checks if "max abs diff" in c.detail]
    bad = [c.line() for c in checks if not c.ok]
    return Cell(model_type, head, not bad, max(diffs) if diffs else None, "; ".join(bad) or f"{len(checks)} checks")


def run_matrix(cells: Iterable[tuple[str, str, str | None]], on_cell: Callable[[Cell], None] | None = None,
               device: str = "cpu") -> list[Cell]:
    results = []
    with tempfile.TemporaryDirectory(prefix="kiln-matrix-") as tmp:
        for model_type, head, src in cells:
            cell = run_cell(model_type, head, src, Path(tmp), device)
            results.append(cell)
            if on_cell:
                on_cell(cell)
    return results
