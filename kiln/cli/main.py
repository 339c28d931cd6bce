"""Entry point of the `kiln` console script.

Each command module exposes `register(app)`. A `KilnError` (or any ValueError/OSError from bad
input) is printed as one message, without a traceback, and the exit status is 1.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer
from rich.console import Console

# Command groups, in help order. A new group is one module with `register(app)` and one line here.
COMMAND_MODULES = [
    "kiln.cli.probe",
    "kiln.cli.models",
    "kiln.cli.train",
]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="kiln: train, convert and verify HuggingFace-format models.")
err = Console(stderr=True)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main(argv: list[str] | None = None) -> None:
    from kiln.errors import KilnError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit:
        raise
    except KilnError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
