"""Entry point of the `kiln` console script.

Each command module exposes `register(app)`. A `KilnError` (or any ValueError/OSError from bad
input) is printed as one message, without a traceback, and the exit status is 1.
"""

from __future__ import annotations

import importlib
import os

import typer
from rich.console import Console
from typer.core import TyperGroup

from kiln.errors import KilnError

# Command groups, in help order. A new group is one module with `register(app)` and one line here.
COMMAND_MODULES = [
    "kiln.cli.probe",
    "kiln.cli.models",
    "kiln.cli.train",
    "kiln.cli.llm",
    "kiln.cli.data",
]

err = Console(stderr=True)


class _KilnGroup(TyperGroup):
    """Turns a user error raised by any command into one printed message and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KilnError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


app = typer.Typer(cls=_KilnGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="kiln: train, convert and verify HuggingFace-format models.")

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app(args=argv)


if __name__ == "__main__":
    main()
