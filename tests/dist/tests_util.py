"""Run the kiln CLI in a fresh process, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kiln_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True, text=True, env=full,
                          cwd=REPO, timeout=300)
