"""The verify matrix machinery: the grid, keeping going past a failing cell, the exit status.

The full matrix (every family x head) runs in CI as `kiln verify-matrix` from `make test`.
"""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.interop.matrix import default_cells


def test_default_cells_cover_every_encoder_family_and_head():
    cells = {(f, h) for f, h, _ in default_cells()}
    for family in ("bert", "roberta", "xlm-roberta", "distilbert"):
        for head in ("base", "sequence-classification", "token-classification", "question-answering", "masked-lm"):
            assert (family, head) in cells


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
