"""The verify matrix machinery: the grid, keeping going past a failing cell, the exit status, and every
registered family having a tiny config (one without is a failed row, never a missing one).

The full matrix (every family x head) runs cell by cell in tests/models/test_parity.py (fast tier) and as
`kiln verify-matrix` from `make test`.
"""

from __future__ import annotations

import dataclasses
import json
import re

from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.interop import matrix
from kiln.interop.matrix import default_cells, missing_tiny
from kiln.models.auto import REGISTRY


def test_default_cells_cover_every_encoder_family_and_head():
    cells = {(f, h) for f, h, _ in default_cells()}
    for family in ("bert", "roberta", "xlm-roberta", "distilbert"):
        for head in ("base", "sequence-classification", "token-classification", "question-answering", "masked-lm"):
            assert (family, head) in cells


def test_default_cells_are_each_family_with_exactly_its_heads():
    """Rows carry only the heads a family has (no masked-lm cell for a decoder), every one of them."""
    cells = [(f, h) for f, h, _ in default_cells()]
    assert cells == [(t, h) for t, family in REGISTRY.items() for h in family.tasks]
    assert ("llama", "causal-lm") in cells and ("llama", "masked-lm") not in cells


def test_every_registered_family_has_a_tiny_config():
    """A family in the registry without a `Tiny` cannot be parity-tested or verified."""
    missing = [why for why in map(missing_tiny, REGISTRY) if why]
    assert not missing, "\n".join(missing)


def test_family_without_a_tiny_config_is_a_failed_row(monkeypatch):
    """Not silently absent from the grid: every head of the family is a FAIL cell naming what is missing."""
    monkeypatch.setattr(matrix, "REGISTRY", {"distilbert": dataclasses.replace(REGISTRY["distilbert"], tiny=None)})
    heads = list(REGISTRY["distilbert"].tasks)
    assert [(f, h) for f, h, _ in default_cells()] == [("distilbert", h) for h in heads]
    r = CliRunner().invoke(app, ["verify-matrix"], terminal_width=200)
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert re.search(rf"│ distilbert( │ FAIL){{{len(heads)}}} │", text), text  # the grid row
    assert text.count("registered family 'distilbert' declares no tiny test model") == len(heads)
    assert f"{len(heads)} of {len(heads)} cells failed" in text


def test_cells_file_with_a_broken_directory_keeps_going_and_fails(tiny_factory, tmp_path):
    good = tiny_factory("distilbert", "question-answering")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([{"family": "bert", "head": "base", "path": str(broken)},
                                 {"family": "distilbert", "head": "question-answering", "path": str(good)}]))
    r = CliRunner().invoke(app, ["verify-matrix", "--cells", str(cells)], terminal_width=200)
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())  # rich wraps long lines at the runner's terminal width
    assert re.search(r"FAIL\s+bert\s+base", text) and "no weights found" in text
    assert re.search(r"PASS\s+distilbert\s+qa", text)  # the cell after the failure still ran
    assert "1 of 2 cells failed" in text


def test_bad_cells_file_is_named(tmp_path):
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([{"family": "bert"}]))
    r = CliRunner().invoke(app, ["verify-matrix", "--cells", str(cells)])
    assert r.exit_code == 1 and "item 0 must be an object with family, head and path" in r.output
