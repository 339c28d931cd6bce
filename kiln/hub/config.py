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
        raise ConfigError(f"{model_dir}: no config.json in this directory; is it an HF model directory?")
    return read_json(path, error=ConfigError, want=dict)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file, fsync, rename: a reader never sees half a file."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_config(model_dir: str | os.PathLike, config: dict[str, Any]) -> Path:
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.json"
    write_json_atomic(path, config)
    return path
