"""config.json in and out, as plain dicts; typed family configs live with the families."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.hub.files import why_unreadable, write_text_atomic
from kiln.hub.jsonio import read_json


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Read `model_dir/config.json` into a dict, with errors that name the file."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ConfigError(f"{model_dir}: no such directory")
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: not a directory (expected an HF model directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        if path.is_symlink() or path.exists():  # there, but no file behind it: say why, not "no config.json"
            raise ConfigError(f"{path}: {why_unreadable(path)}")
        raise ConfigError(f"{model_dir}: no config.json in this directory; {_what_instead(model_dir)}")
    return read_json(path, error=ConfigError, want=dict)


def _what_instead(folder: Path) -> str:
    """A hint for a folder given where a model directory belongs: a run's checkpoint or run directory holds one."""
    if (folder / "model" / "config.json").is_file():
        return f"it is a run checkpoint: its model directory is {folder / 'model'}"
    ckpts = sorted(p for p in folder.glob("ckpt-*") if (p / "model" / "config.json").is_file())
    if ckpts:
        return f"it is a run directory: its newest checkpoint's model is {ckpts[-1] / 'model'}"
    return "is it an HF model directory?"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file, fsync, rename: a reader never sees half a file."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_config(model_dir: str | os.PathLike, config: dict[str, Any]) -> Path:
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.json"
    write_json_atomic(path, config)
    return path
