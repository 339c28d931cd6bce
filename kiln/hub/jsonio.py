"""JSON and JSONL files in, with errors a user can act on: they name the file and the line.

`read_json` reads one document (config.json, a shard index, a manifest); `iter_jsonl` reads one
value per line (data files, metrics logs), skipping blank lines. Both raise the caller's KilnError
subclass, so a config file fails as a ConfigError and a weights index as a WeightsError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark
_KINDS: dict[type, str] = {dict: "object", list: "array"}


def read_json(path: str | os.PathLike, error: type[KilnError] = KilnError, want: type | None = None) -> Any:
    """The JSON document in `path`; `want` (dict or list) is the type the top level must have."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a BOM (Windows editors write one) is not JSON's
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read ({e})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if want is not None and not isinstance(value, want):
        raise error(f"{path}: expected a JSON {_KINDS.get(want, want.__name__)} at the top level, got {type(value).__name__}")
    return value


def iter_jsonl(path: str | os.PathLike, error: type[KilnError] = KilnError, objects: bool = True,
               encoding_errors: str = "strict", hint: str = "re-encode the file as UTF-8",
               torn_tail: bool = False) -> Iterator[tuple[int, Any, int]]:
    """(line number, value, bytes of the line) per non-blank line of a JSONL file.

    `objects`: every line must hold a JSON object. `encoding_errors` is Python's ("replace" keeps
    going past bytes that are not UTF-8); `hint` ends the message when it stops there instead.
    `torn_tail`: a last line without its newline that is not valid JSON is dropped, not an error
    (a log whose writer was killed mid-line).
    """
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - opened apart from the `with` so only the open's errors read "cannot be read"
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e})") from None
    with f:
        for no, raw in enumerate(f, 1):
            if no == 1 and raw.startswith(BOM):  # a file saved "UTF-8 with BOM" (Notepad, Excel) is UTF-8 text
                raw = raw[len(BOM):]
            try:
                line = raw.decode("utf-8", errors=encoding_errors)
            except UnicodeDecodeError as e:
                raise error(f"{path}:{no}: not valid UTF-8 at byte {e.start} of the line ({e.reason}); {hint}") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                if torn_tail and not raw.endswith(b"\n"):  # only the last line can lack one
                    return
                raise error(f"{path}:{no}: not valid JSON ({e.msg} at column {e.colno})") from None
            if objects and not isinstance(value, dict):
                raise error(f"{path}:{no}: expected a JSON object per line, got {type(value).__name__}")
            yield no, value, len(raw)
