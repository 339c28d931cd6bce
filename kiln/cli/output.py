"""How the CLI prints: text exactly as given, never read as Rich markup.

A prompt, a path or an error message may hold `[brackets]`; Rich would treat them as style tags
(dropping them, or failing on a stray `[/b]`). These consoles have markup and highlighting off;
styles are set on `Text` objects instead. On a terminal lines wrap to the window as the terminal
wraps them; into a pipe or a file nothing is wrapped or cut (tables get all the width they need).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol

from rich.console import Console
from rich.text import Text

# Width for tables when not on a terminal: wide enough that no cell is ever wrapped.
_UNBOUNDED = 1 << 16


def console(stderr: bool = False) -> Console:
    """A console on the current stdout (or stderr), made per call so a redirected stream is honoured."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, markup=False, highlight=False, emoji=False, soft_wrap=True,
                   width=None if tty else _UNBOUNDED)


class _Printer:
    def __init__(self, stderr: bool):
        self.stderr = stderr

    def print(self, *objects: Any, style: str | None = None, **kwargs: Any) -> None:
        console(self.stderr).print(*objects, style=style, **kwargs)


out = _Printer(stderr=False)
err = _Printer(stderr=True)


def styled(text: str, style: str) -> Text:
    """`text` in `style` (a table cell or a line), its brackets kept as they are."""
    return Text(text, style=style)


def note(message: str) -> None:
    """A line for the user beside the command's output (on stderr, so a pipe gets only the output)."""
    err.print(f"note: {message}")


class Check(Protocol):
    """One line of a verification: whether it held, and how to print it."""

    ok: bool

    def line(self) -> str: ...


def report_checks(checks: Sequence[Check]) -> bool:
    """Each check's line (green held, red failed), then the count; True when every check held."""
    for c in checks:
        out.print(styled(c.line(), "green" if c.ok else "red"))
    failed = sum(not c.ok for c in checks)
    if failed:
        out.print(styled(f"{failed} of {len(checks)} checks failed", "red"))
        return False
    out.print(styled(f"all {len(checks)} checks passed", "green"))
    return True
