"""Run the kiln CLI in a fresh process, as a user would (shared by the test folders; not a test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kiln(*args: str, env: dict | None = None, check: bool = True, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kiln_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same, returning whatever the process did (for tests that assert on failures)."""
    return kiln(*args, env=env, check=False)
