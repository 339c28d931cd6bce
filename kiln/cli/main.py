"""Entry point of the `kiln` console script, and its one error boundary.

Each command module exposes `register(app)`. A user error (kiln.cli.boundary) raised by any
command is printed as `kiln: <message>` with exit status 1 and no traceback; any other exception is
a bug and keeps its traceback. KILN_DEBUG=1 shows tracebacks always.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer._click import exceptions as click_errors  # typer vendors its own click
from typer._click.core import Context
from typer.core import TyperGroup

from kiln.cli.boundary import report, user_message
from kiln.cli.common import share_cores_for
from kiln.cli.lifeline import die_with_parent
from kiln.constants import LAUNCH_DIR_ENV

_parent_at_start = os.getppid()  # before the imports below take their time: a parent gone by then is noticed

# Command groups, in help order. A new group is one module with `register(app)` and one line here.
COMMAND_MODULES = [
    "kiln.cli.probe",
    "kiln.cli.models",
    "kiln.cli.train",
    "kiln.cli.plan",
    "kiln.cli.llm",
    "kiln.cli.chat",
    "kiln.cli.serve",
    "kiln.cli.eval",
    "kiln.cli.data",
    "kiln.cli.init",
]


class _KilnGroup(TyperGroup):
    """Turns a user error raised by any command into one printed message and exit status 1, and a
    usage error (unknown option, missing value) into one plain line and exit status 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except click_errors.UsageError as e:
            hint = f" (try '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            typer.echo(f"kiln: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except click_errors.ClickException as e:
            typer.echo(f"kiln: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("kiln: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # `kiln ... | head`: the reader left; nothing to say
            raise typer.Exit(1) from None
        except Exception as e:
            message = user_message(e)
            if message is None or os.environ.get("KILN_DEBUG", "") not in ("", "0"):
                raise
            report(message)
            raise typer.Exit(1) from None


app = typer.Typer(cls=_KilnGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="kiln: train, convert and verify HuggingFace-format models.")

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main(argv: list[str] | None = None) -> None:
    if os.environ.get(LAUNCH_DIR_ENV):  # a rank of `kiln launch`: it ends when torchrun (its parent) does
        die_with_parent(_parent_at_start)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    share_cores_for(sys.argv[1:] if argv is None else argv)  # a train beside other kiln runs: its share of the cores
    app(args=argv)


if __name__ == "__main__":
    main()
