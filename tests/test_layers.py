"""The layering of ARCHITECTURE.md holds: each package imports only from the layers under it."""

from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"
OPEN = {"errors", "constants", "__init__"}  # modules every layer may import
ALLOWED = {
    "hub": set(),
    "data": {"hub"},
    "models": {"hub", "data"},
    "parallel": {"models", "hub"},
    "train": {"parallel", "models", "data", "hub"},
    "interop": {"models", "hub"},
    "pipelines": {"models", "hub"},
    "cli": {"hub", "data", "models", "parallel", "train", "interop", "pipelines"},
}


def _imports(path: Path) -> set[str]:
    """The kiln top-level packages a file imports (at module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_imports_only_from_the_layers_below():
    bad = []
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(KILN)
        top = rel.parts[0].removesuffix(".py")
        if top in OPEN:
            continue
        assert top in ALLOWED, f"{rel}: package {top!r} has no layer in ARCHITECTURE.md / this test"
        for imported in _imports(path) - OPEN - {top}:
            if imported not in ALLOWED[top]:
                bad.append(f"kiln/{rel} imports kiln.{imported}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from kiln.train import Trainer\nimport kiln.cli.main\n")
    assert _imports(f) == {"train", "cli"}
