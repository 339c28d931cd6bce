"""tests/parallel: spawned gloo process groups on CPU; workers live in workers.py (importable by the children)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
