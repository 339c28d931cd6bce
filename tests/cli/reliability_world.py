"""Helpers for the reliability tables (inputs read or refused, caches, exit codes, validation): a snapshot that
sees symbolic links as links (a dangling one is the case under test, so it is never followed), and tiny
from-scratch run configs that need no model directory (not a test module)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.cli.bad_inputs_world import write_toml

TINY_QWEN3 = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root`: a file's sha256 and mtime, a link's target, a folder's name."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = os.path.relpath(p, root)
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = None
            else:
                out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def raw_shards(folder: Path, n: int = 4, tokens: int = 400, seed: int = 0) -> Path:
    """`n` uint16 token files of ids below 64 in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        rng.integers(0, 64, tokens, dtype=np.uint16).tofile(folder / f"shard-{i:03d}.bin")
    return folder


def pretrain_config(path: Path, tokens: Path, out_dir: Path, config: dict | None = None, family: str = "qwen3",
                    **sections) -> Path:
    """A from-scratch pretrain run on raw uint16 token ids (config: changes to the tiny config; None drops a key)."""
    config = {k: v for k, v in {**TINY_QWEN3, **(config or {})}.items() if v is not None}
    return write_toml(path, {
        "model": {"family": family, "task": "causal-lm", "config": config},
        "data": {"train": tokens, "max_length": 16, "dtype": "uint16", **sections.pop("data", {})},
        "train": {"out_dir": out_dir, "steps": 2, "batch_size": 2, "progress": False, "device": "cpu",
                  **sections.pop("train", {})}, **sections})


def run_cli(*args) -> tuple[int, str]:
    """(exit code, output) of the CLI run in this process; an exception other than SystemExit is raised."""
    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, " ".join(r.output.split())
