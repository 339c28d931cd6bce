"""What several commands share: flag range checks and loading a model to predict with.

A model loaded for prediction must hold what it predicts with: a head the directory does not have
(classify on a masked-LM directory) or weights its config.json does not describe are refused
(kiln.interop.load_report) unless --allow-missing / --allow-unused say otherwise, and whatever was
dropped or initialised is said on stderr.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from kiln.cli.output import note
from kiln.errors import KilnError

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
