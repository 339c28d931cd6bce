"""`make bench-check`: rerun the benchmarks whose code a change touched and flag any ratio more than 10% below
its row in benchmarks/RESULTS.md.

A change is what `git diff` shows against the merge base with BASE (default main), working tree and untracked
files included. A benchmark's code is its own file, the benchmark modules it imports (common.py ...) and the
kiln files it loads: those its processes loaded in the last `make bench` (benchmarks/deps.json, written by
run_all.py through deps_hook/sitecustomize.py), else, for a benchmark not recorded there, every kiln module its
source imports, followed through kiln's own imports (more than it loads: a conservative guess). Each touched
workload of run_all.py's WORKLOADS is run as `make bench` runs it; its new best ratio is compared with the
best ratio of the RESULTS.md row of the same workload name. Not a test: speed is measured here, never in CI.

    .venv/bin/python benchmarks/check.py [--base main] [--dry-run] [--tolerance 0.10] [--only NAME[,NAME...]]

`--only NAME[,NAME...]` reruns only the touched benchmarks whose file name contains one of the NAMEs (as run_all.py's
--only; `bench_grpo.py` names that file alone): a quick check of one benchmark, or a long check split into parts.

Exit status 1 when a ratio fell by more than the tolerance, 0 otherwise (no touched benchmark included).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from run_all import WORKLOADS, read_table  # noqa: E402

DEPS = HERE / "deps.json"
TOLERANCE = 0.10


def changed_files(base: str, root: Path = ROOT) -> set[str]:
    """Paths (relative to the repository) that differ from the merge base with `base`, or are new and untracked."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"git {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    point = git("merge-base", base, "HEAD").strip()
    return {p for p in (git("diff", "--name-only", point) + git("ls-files", "--others", "--exclude-standard")
                        ).splitlines() if p}


def _module_file(name: str, root: Path) -> Path | None:
    p = root.joinpath(*name.split("."))
    for f in (p / "__init__.py", p.with_suffix(".py")):
        if f.is_file():
            return f
    return None


@functools.cache  # each file parsed once for all the benchmarks (27 walks of kiln's imports took ~20 s of CPU)
def _imported(path: Path, root: Path) -> frozenset[Path]:
    """Files of the kiln modules and sibling benchmark modules `path` imports anywhere (function bodies too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == "kiln":
            out |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i]), root))}
        elif len(parts) == 1 and (root / "benchmarks" / f"{name}.py").is_file():
            out.add(root / "benchmarks" / f"{name}.py")
    return frozenset(out)


def static_deps(script: str, root: Path = ROOT) -> set[str]:
    """A benchmark's file, the benchmark modules and kiln modules its source imports, and theirs, transitively."""
    seen: set[Path] = set()
    todo = [root / "benchmarks" / script]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += _imported(f, root) - seen
    return {str(f.relative_to(root)) for f in seen}


def deps_of(script: str, recorded: dict[str, list[str]], root: Path = ROOT) -> set[str]:
    """What a change must touch to touch this benchmark: recorded by the last `make bench`, else the static guess."""
    if script in recorded:
        return {f"benchmarks/{script}"} | set(recorded[script])
    return static_deps(script, root)


def touched(changed: set[str], recorded: dict[str, list[str]], root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """run_all's workloads whose code is among the changed files, in its order."""
    return [(s, a) for s, a in WORKLOADS if changed & deps_of(s, recorded, root)]


def recorded_ratios(results: str) -> dict[str, float]:
    """Workload name -> best ratio of its last row in RESULTS.md's tables (run_all.read_table): rows are appended
    as they are measured, so the last row of a name is its newest measurement."""
    return {row["workload"]: row["ratio_best"] for row in read_table(results)}


def verdicts(rows: list[dict], recorded: dict[str, float], tolerance: float = TOLERANCE) -> list[tuple[str, str, bool]]:
    """(workload, line, fell) per measured row: fell when its best ratio is below (1 - tolerance) x the recorded."""
    out = []
    for r in rows:
        name, now = r["workload"], r["ratio_best"]
        was = recorded.get(name)
        if was is None:
            out.append((name, f"{name}: {now:.2f}x (median {r['ratio_median']:.2f}x); no RESULTS.md row to compare",
                        False))
            continue
        fell = now < (1 - tolerance) * was
        out.append((name, f"{name}: {now:.2f}x (median {r['ratio_median']:.2f}x) against {was:.2f}x in RESULTS.md "
                          f"({now / was - 1:+.0%})" + ("  FELL" if fell else ""), fell))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="main")
    ap.add_argument("--dry-run", action="store_true", help="name the touched benchmarks, run nothing")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--only", default="", help="comma-separated: rerun only the touched benchmarks whose file name "
                    "contains one of these")
    a = ap.parse_args()
    changed = changed_files(a.base)
    recorded = json.loads(DEPS.read_text()) if DEPS.is_file() else {}
    runs = [(s, x) for s, x in touched(changed, recorded) if any(n in s for n in a.only.split(","))]
    print(f"{len(changed)} file(s) changed against {a.base}; benchmarks touched"
          + (f" (file names containing {a.only!r})" if a.only else "") + ": "
          + (", ".join(f"{s} {' '.join(x)}".strip() for s, x in runs) or "none")
          + ("" if DEPS.is_file() else f" ({DEPS.name} absent: each benchmark's kiln imports followed statically, "
             "more than it loads; `make bench` records what each loads)"), flush=True)
    if a.dry_run or not runs:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        env = {**os.environ, "BENCH_JSON": str(rows_file), "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        for script, args in runs:
            print(f"\n$ python benchmarks/{script} {' '.join(args)}", flush=True)
            started = time.time()
            subprocess.run([sys.executable, str(HERE / script), *args], env=env, check=True)
            print(f"({script}: {time.time() - started:.0f} s, load average {os.getloadavg()[0]:.1f})", flush=True)
        rows = [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()] if rows_file.exists() else []
    results = (HERE / "RESULTS.md").read_text(encoding="utf-8")
    lines = verdicts(rows, recorded_ratios(results), a.tolerance)
    print(f"\nbench-check against {a.base} (load average {os.getloadavg()[0]:.1f}): ratios more than "
          f"{a.tolerance:.0%} below RESULTS.md are marked FELL")
    for _, line, _ in lines:
        print("  " + line)
    return 1 if any(fell for *_, fell in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
