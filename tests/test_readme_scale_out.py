"""The README's scale-out TOMLs are valid [parallel] tables (a renamed or removed key fails here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kiln.train.config import ParallelSection

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end != -1 else len(text)]


def test_every_scale_out_toml_is_a_valid_parallel_table():
    blocks = re.findall(r"```toml\n(.*?)```", _section("Scaling out"), flags=re.S)
    assert len(blocks) >= 5  # DDP, FSDP2, TP, EP, cadence
    for block in blocks:
        table = tomllib.loads(block)
        assert set(table) == {"parallel"}, block
        ParallelSection(**table["parallel"])  # pydantic: unknown keys and bad values raise
