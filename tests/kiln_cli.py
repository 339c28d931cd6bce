"""Run the kiln CLI in a fresh process, as a user would (shared by the test folders; not a test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kiln(*args: str, env: dict | None = None, check: bool = True, cwd: Path = REPO,
         timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    child = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: `kiln launch` passes it on to its ranks (torchrun runs in a session of its own, which a
        # SIGKILL of this process would leave running for the rest of the suite)
        child.terminate()
        try:
            out, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
        raise AssertionError(f"kiln {' '.join(args)} still ran after {timeout} s:\n{out}\n{err}") from None
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kiln_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same, returning whatever the process did (for tests that assert on failures)."""
    return kiln(*args, env=env, check=False)
