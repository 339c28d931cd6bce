"""`kiln eval DIR_OR_RUN --tasks ...`: lm-evaluation-harness tasks on a model directory, a run (its newest
checkpoint) or a checkpoint, through kiln's own model code (kiln.interop.lmeval); no export needed.
Results are printed and written beside the run (RUN_DIR/lm_eval_results.json), or into the model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kiln.cli.common import check_range
from kiln.cli.output import out
from kiln.errors import KilnError

RESULTS_FILE = "lm_eval_results.json"


def model_dir_of(target: Path) -> tuple[Path, Path]:
    """(the model directory, the folder results go to) of a model directory, a checkpoint or a run (its newest
    checkpoint)."""
    from kiln.train.checkpoint import list_checkpoints

    if not target.is_dir():
        raise KilnError(f"{target}: no such model, checkpoint or run directory")
    if (target / "config.json").is_file():
        return target, target
    if (target / "model" / "config.json").is_file():  # a checkpoint: results go to its run
        return target / "model", target.parent
    ckpts = list_checkpoints(target)
    if not ckpts:
        raise KilnError(f"{target}: neither a model directory (config.json) nor a run with checkpoints (ckpt-N)")
    return ckpts[-1][1] / "model", target


def load_for_eval(target: Path) -> tuple[Any, Path]:
    """(kiln causal LM, the folder its results go to) for a model directory, a checkpoint or a run."""
    from kiln.models.auto import load_pretrained
    from kiln.models.tasks import CAUSAL_LM

    model_dir, home = model_dir_of(target)
    return load_pretrained(model_dir, task=CAUSAL_LM), home


def eval_cmd(target: Path = typer.Argument(..., help="A causal-LM directory, a run directory (its newest "
                                                    "checkpoint) or a checkpoint RUN_DIR/ckpt-N."),
             tasks: str = typer.Option(..., "--tasks", help="Comma-separated lm-eval task names."),
             include: list[Path] | None = typer.Option(None, "--include", help="A folder of task YAMLs of your "
                                                          "own (local data files work offline); repeatable."),
             num_fewshot: int | None = typer.Option(None, "--num-fewshot"),
             limit: int | None = typer.Option(None, "--limit", help="At most this many documents per task."),
             batch_size: int = typer.Option(8, "--batch-size"),
             device: str = typer.Option("cpu", "--device"),
             seed: int = typer.Option(0, "--seed"),
             out_file: Path | None = typer.Option(None, "--out", help=f"Results JSON (default: {RESULTS_FILE} "
                                                     "in the run or model directory).")) -> None:
    """Score a model on lm-evaluation-harness tasks (log-likelihood, rolling log-likelihood, generation)."""
    from kiln.interop.lmeval import evaluate

    check_range("--batch-size", batch_size, 1)
    if num_fewshot is not None:
        check_range("--num-fewshot", num_fewshot, 0)
    if limit is not None:
        check_range("--limit", limit, 1)
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise KilnError("--tasks names no task")
    for folder in include or []:
        if not folder.exists():
            raise KilnError(f"--include {folder}: no such file or folder")
    model, home = load_for_eval(target)
    results = evaluate(model, names, include, num_fewshot, limit, batch_size, device, seed)
    for task, metrics in results["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, (int, float)) and not k.startswith(("alias", "sample")) and "stderr" not in k)
        out.print(f"{task}: {shown}")
    dest = out_file or home / RESULTS_FILE
    from kiln.hub.files import write_text_atomic  # kiln.hub imports torch: `kiln --help` stays light

    write_text_atomic(dest, json.dumps({"model": str(target), **results}, indent=2) + "\n")  # whole or not at all
    out.print(f"wrote {dest}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
