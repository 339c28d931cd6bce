"""The demo shows held-out articles of every class, not the first few rows (which are all one class)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _demo():
    spec = importlib.util.spec_from_file_location("kiln_demo", Path(__file__).resolve().parents[1] / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_samples_one_article_per_class(tmp_path):
    labels = ["business"] * 40 + ["entertainment"] * 30 + ["politics"] * 30 + ["sport"] * 50 + ["tech"] * 20
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"text": f"article {i}", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    rows = _demo().sample_per_class(f)
    assert [r["label"] for r in rows] == ["business", "entertainment", "politics", "sport", "tech"]
    assert [r["text"] for r in rows] == ["article 0", "article 40", "article 70", "article 100", "article 150"]
    assert len({r["label"] for r in _demo().sample_per_class(f, per_class=2)}) == 5
