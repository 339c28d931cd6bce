"""Every benchmarks/bench_*.py is run by `make bench` (benchmarks/run_all.py's WORKLOADS) or says in its module
docstring that it is run by hand, and why.

The marker is a docstring paragraph starting "Run by hand (not in `make bench`): " followed by the reason.
Both files are read with `ast` (no benchmark is imported: they import torch and transformers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MARKER = re.compile(r"^Run by hand \(not in `make bench`\): (.+)", re.MULTILINE)
MIN_REASON = 20  # characters: a reason is a sentence, not "n/a"


def run_all_scripts(run_all: Path) -> set[str]:
    """The script names in run_all.py's WORKLOADS list of (script, arguments)."""
    for node in ast.parse(run_all.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "WORKLOADS" for t in node.targets):
            return {script for script, _args in ast.literal_eval(node.value)}
    raise AssertionError(f"{run_all}: no WORKLOADS list")


def by_hand_reason(path: Path) -> str | None:
    """The reason a benchmark gives for being run by hand, or None when its docstring has no marker."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = MARKER.search(doc)
    return m.group(1).strip() if m else None


def problems(bench_dir: Path) -> list[str]:
    """Every benchmark neither in run_all nor marked, marked both ways, or named in run_all but missing."""
    listed = run_all_scripts(bench_dir / "run_all.py")
    out = []
    for path in sorted(bench_dir.glob("bench_*.py")):
        reason = by_hand_reason(path)
        if path.name in listed and reason is not None:
            out.append(f"{path.name}: in run_all.py's WORKLOADS and marked as run by hand")
        elif path.name not in listed and reason is None:
            out.append(f"{path.name}: not in run_all.py's WORKLOADS and its docstring has no "
                       f"'Run by hand (not in `make bench`): <reason>' paragraph")
        elif reason is not None and len(reason) < MIN_REASON:
            out.append(f"{path.name}: run-by-hand reason too short: {reason!r}")
    out += [f"run_all.py names {name}, which does not exist" for name in sorted(listed)
            if not (bench_dir / name).is_file()]
    return out


def test_every_benchmark_is_run_or_marked() -> None:
    assert problems(BENCH) == []


def test_the_check_catches_an_unlisted_benchmark(tmp_path: Path) -> None:
    # Control: a copy of benchmarks/ plus an unlisted, unmarked benchmark fails; marking it passes.
    for f in BENCH.glob("*.py"):
        (tmp_path / f.name).write_text(f.read_text())
    new = tmp_path / "bench_new.py"
    new.write_text('"""A new benchmark."""\n')
    assert problems(tmp_path) == ["bench_new.py: not in run_all.py's WORKLOADS and its docstring has no "
                                  "'Run by hand (not in `make bench`): <reason>' paragraph"]
    new.write_text('"""A new benchmark.\n\nRun by hand (not in `make bench`): x\n"""\n')
    assert problems(tmp_path) == ["bench_new.py: run-by-hand reason too short: 'x'"]
    new.write_text('"""A new benchmark.\n\nRun by hand (not in `make bench`): it needs two GPUs to mean anything.\n"""\n')
    assert problems(tmp_path) == []
    # A listed benchmark that also says "by hand" contradicts itself; a listed name must exist.
    lora = tmp_path / "bench_lora_sft.py"
    lora.write_text('"""SFT.\n\nRun by hand (not in `make bench`): a contradiction with run_all.\n"""\n')
    assert problems(tmp_path) == ["bench_lora_sft.py: in run_all.py's WORKLOADS and marked as run by hand"]
    lora.unlink()
    assert problems(tmp_path) == ["run_all.py names bench_lora_sft.py, which does not exist"]
