"""`kiln --help` and every `kiln <command> --help` stay light: no torch, no transformers.

Each help runs in a fresh `python -X importtime -m kiln.cli.main ...`, whose import log names every
module the process imported. Timing is what this buys (help went from ~4 s to ~0.3 s), but a wall
time on a shared machine is too noisy to assert; the imports are what decide it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer

from kiln.cli.main import app
from tests.kiln_cli import REPO

HEAVY = ("torch", "transformers")


def _command_paths() -> list[tuple[str, ...]]:
    """Every command path of the CLI, the root first (`()`, `("train",)`, `("tokenizer", "train")`, ...)."""
    paths: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        paths.append(path)
        for name in getattr(cmd, "commands", {}):  # a group: its subcommands
            walk(cmd.commands[name], (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def _imports(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime ARGS`; the process and the top-level packages it imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    # lines: "import time: <self us> | <cumulative us> | <indented module name>"
    names = {line.rsplit("|", 1)[1].strip().split(".")[0]
             for line in proc.stderr.splitlines() if line.startswith("import time:") and line.count("|") == 2}
    return proc, names


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "kiln")
def test_help_imports_no_torch(path):
    proc, imported = _imports("-m", "kiln.cli.main", *path, "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Usage:" in proc.stdout
    assert not imported & set(HEAVY), f"kiln {' '.join(path)} --help imported {sorted(imported & set(HEAVY))}"


def test_import_log_sees_torch():
    """Control: the same check on a kiln entry point that does import torch at module level."""
    proc, imported = _imports("-m", "kiln.cli.torchrun", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" in imported and "typer" not in imported


def test_command_paths_cover_groups():
    """The walk reaches nested commands, so a new group's commands are checked too."""
    paths = _command_paths()
    assert () in paths and ("train",) in paths and ("tokenizer", "train") in paths


def test_recipe_flags_match_recipes():
    """kiln.cli.recipe_flags (read by `kiln train --help`) is the recipes' shortcut table, in order."""
    from kiln.cli.recipe_flags import shortcuts as cli_flags
    from kiln.train.recipes import shortcuts

    live = [(s.flag, s.key, s.multiple) for s in shortcuts()]
    table = [(f.flag, f.key, f.multiple) for f in cli_flags()]
    assert table == live, ("kiln/cli/recipe_flags.py differs from the recipes' shortcuts; make its table "
                           f"{live}")
