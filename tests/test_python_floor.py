"""The Python floor is said once and agreed everywhere: pyproject's requires-python, the README, the Makefile's check."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_floor_agrees():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=3\.(\d+)", spec)
    assert m, f"pyproject requires-python {spec!r}: expected '>=3.N'"
    minor = int(m.group(1))
    assert minor >= 11, "kiln.train.config imports tomllib (Python 3.11+)"
    assert sys.version_info[:2] >= (3, minor)
    readme = (ROOT / "README.md").read_text()
    assert f'requires-python = ">=3.{minor}"' in readme and f"Python 3.{minor} or newer" in readme
    assert f"sys.version_info < (3, {minor})" in (ROOT / "Makefile").read_text()
