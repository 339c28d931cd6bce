"""Which kiln files a benchmark's process loaded: `make bench` (benchmarks/run_all.py) puts this folder on the
PYTHONPATH of every benchmark with BENCH_DEPS naming a folder, and each process writes there, at exit, the kiln
source files in its sys.modules (one JSON list per process). benchmarks/check.py reads the merged lists
(benchmarks/deps.json) to tell which benchmarks a change touched."""

import atexit
import json
import os
import sys


def _record() -> None:
    folder, root = os.environ.get("BENCH_DEPS"), os.environ.get("BENCH_ROOT")
    if not folder or not root:
        return
    kiln = os.path.join(root, "kiln") + os.sep
    files = sorted({os.path.relpath(f, root) for m in list(sys.modules.values())
                    if isinstance(f := getattr(m, "__file__", None), str) and os.path.abspath(f).startswith(kiln)})
    try:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w", encoding="utf-8") as out:
            json.dump(files, out)
    except OSError:  # a benchmark's result never depends on this record
        pass


if os.environ.get("BENCH_DEPS"):
    atexit.register(_record)
