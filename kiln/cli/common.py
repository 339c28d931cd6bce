"""What several commands share: flag range checks and loading a model to predict with.

A model loaded for prediction must hold what it predicts with: a head the directory does not have
(classify on a masked-LM directory) or weights its config.json does not describe are refused
(kiln.interop.load_report) unless --allow-missing / --allow-unused say otherwise, and whatever was
dropped or initialised is said on stderr.
"""

from __future__ import annotations

import functools
import math
import traceback
from pathlib import Path
from typing import Any, Callable

import typer

from kiln.cli.output import note
from kiln.errors import KilnError

# Exit codes of `kiln train` (README, "Exit codes"): what a scheduler script needs to decide on a requeue.
# 2 is a command-line usage error (typer); a second SIGTERM / SIGINT ends the process by that signal (128 + N).
EXIT_OK = 0
EXIT_USER_ERROR = 1      # bad config, data or paths: the message says what to fix; rerunning as is fails again
EXIT_NON_FINITE = 3      # non-finite loss or gradient with train.non_finite = "fail"
EXIT_INTERNAL = 70       # a bug in kiln (traceback printed); EX_SOFTWARE of sysexits.h
EXIT_STOPPED = 75        # stopped by SIGTERM / SIGINT or train.max_time, checkpoint written: requeue with --resume
                         # (EX_TEMPFAIL of sysexits.h)


def exit_codes(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with kiln train's exit codes: a non-finite abort exits EXIT_NON_FINITE with its message, a bug
    EXIT_INTERNAL with its traceback; user errors are left to the CLI's boundary (exit 1)."""
    from kiln.cli.boundary import report, user_message
    from kiln.errors import NonFiniteError

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except NonFiniteError as e:
            report(str(e))
            raise typer.Exit(EXIT_NON_FINITE) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            if user_message(e) is not None:
                raise
            traceback.print_exc()
            raise typer.Exit(EXIT_INTERNAL) from None
    return run


ALLOW_MISSING = typer.Option(False, "--allow-missing", help="Use tensors the directory lacks (e.g. a head) "
                                                            "freshly initialised, instead of refusing.")
ALLOW_UNUSED = typer.Option(False, "--allow-unused", help="Drop tensors the model config does not use, "
                                                          "instead of refusing.")


def check_range(flag: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Refuse `value` outside [low, high] (or (low, high] with `low_open`), or not a finite number."""
    ok = not (isinstance(value, float) and not math.isfinite(value))
    if low is not None:
        ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and value <= high
    if not ok:
        lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        hi = "" if high is None else f"<= {high:g}"
        raise KilnError(f"{flag} must be {' and '.join(x for x in (lo, hi) if x)}, got {value:g}")


def load_for_prediction(model_dir: Path, task: str, allow_missing: bool, allow_unused: bool):
    """The model of `model_dir` with the `task` head, refused if that head or its weights would be made up."""
    from kiln.interop.load_report import check_load
    from kiln.models.auto import load_config, load_pretrained
    from kiln.train.checks import check_model_tokenizer

    source_task = load_config(model_dir)[2]
    model = load_pretrained(model_dir, task=task)
    for line in check_load(model, str(model_dir), source_task, allow_missing=allow_missing,
                           allow_unused=allow_unused):
        note(line)
    if model.tokenizer is None:
        raise KilnError(f"{model_dir}: no tokenizer files (tokenizer.json or vocab.txt) next to the model")
    check_model_tokenizer(model, None, str(model_dir))
    return model


def fit_length(model, n_tokens: int, what: str, cut: bool) -> int | None:
    """The position limit of `model` if `n_tokens` passes it: refused, or (`cut`) noted and returned."""
    from kiln.train.checks import position_limit

    limit = position_limit(model)
    if limit is None or n_tokens <= limit:
        return None
    if not cut:
        raise KilnError(f"{what} is {n_tokens} tokens, more than the model's {limit} positions; shorten it")
    note(f"{what} is {n_tokens} tokens; the model reads the first {limit}, the rest is cut off")
    return limit
