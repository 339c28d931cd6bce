"""tests/parallel: spawned gloo process groups on CPU; workers live in workers.py, imported as
tests.parallel.workers by the children (pytest puts the repository root on sys.path; forkserver children inherit it)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
