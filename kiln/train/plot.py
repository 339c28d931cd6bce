"""`kiln plot RUN_DIR`: loss, learning rate and eval curves from metrics.jsonl (and `kiln eval` scores from
lm_eval_results.json when the run has them), as one PNG.

Training and eval loss share the first panel (one scale, so over-fitting shows as the curves parting);
the learning rate and every other eval_* metric get a panel each. Records are plotted by what they hold: a run logged by other tools (no lr, no loss) still gets the
panels it has data for; a record without a numeric step, or with a value that is not a number, is
an error naming its line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.errors import KilnError
from kiln.hub.jsonio import iter_jsonl

_LABELS = {"loss": "train", "eval_loss": "eval"}


def panels(records: list[dict]) -> list[tuple[str, list[str]]]:
    """(title, keys) per panel: train and eval loss together, then lr, then each other eval_* metric."""
    have = {k for r in records for k in r}
    loss = [k for k in ("loss", "eval_loss") if k in have]
    out = [("loss" if len(loss) == 2 else {"loss": "train loss"}.get(loss[0], loss[0]), loss)] if loss else []
    if "lr" in have:
        out.append(("learning rate", ["lr"]))
    return out + [(k, [k]) for k in sorted(have) if k.startswith("eval_") and k != "eval_loss"]


def harness_scores(run_dir: Path) -> list[tuple[str, float]]:
    """(task metric, value) from the run's lm_eval_results.json (`kiln eval`), stderr left out; [] if none."""
    path = run_dir / "lm_eval_results.json"
    if not path.is_file():
        return []
    try:
        results = json.loads(path.read_text(encoding="utf-8")).get("results", {})
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise KilnError(f"{path}: not a kiln eval results file ({e})") from None
    return [(f"{task} {key.split(',')[0]}", float(v)) for task, metrics in sorted(results.items())
            for key, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in key]


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write RUN_DIR/curves.png (or `out`): training loss, lr, and every eval_* metric by step."""
    run_dir = Path(run_dir)
    log = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise KilnError(f"{run_dir}: no such run directory: no metrics.jsonl records to plot")
    records = []
    for no, r, _ in iter_jsonl(log, torn_tail=True) if log.is_file() else ():
        if not isinstance(r.get("step"), (int, float)):
            raise KilnError(f"{log}:{no}: a record without a numeric 'step'")
        records.append((no, r))
    if not records:
        raise KilnError(f"{run_dir}: no metrics.jsonl records to plot")
    out_path = Path(out) if out is not None else run_dir / "curves.png"
    if out_path.is_dir():
        raise KilnError(f"--out {out_path}: is a directory; give a file name such as curves.png")
    try:
        import matplotlib
    except ImportError:
        raise KilnError("kiln plot needs matplotlib: pip install 'kiln[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    suffix = out_path.suffix.lower().lstrip(".")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise KilnError(f"--out {out_path}: cannot tell an image format from {out_path.suffix or 'no suffix'!r}; "
                        f"use one of .{', .'.join(sorted(formats))}")
    layout = panels([r for _, r in records])
    if not layout:
        raise KilnError(f"{log}: no loss, lr or eval_* values to plot")
    bars = harness_scores(run_dir)
    fig, axes = plt.subplots(1, len(layout) + bool(bars), figsize=(4.2 * (len(layout) + bool(bars)), 3.4),
                             squeeze=False)
    if bars:  # `kiln eval` results beside the run: one bar per task metric
        ax = axes[0][-1]
        ax.barh([name for name, _ in bars], [v for _, v in bars], color="tab:purple")
        ax.set_title("lm-eval")
        ax.grid(alpha=0.3, axis="x")
    for ax, (title, keys) in zip(axes[0], layout):
        for key in keys:
            pts = [(r["step"], _number(r[key], log, no, key)) for no, r in records if key in r]
            style = {"marker": "o", "color": "tab:green"} if key.startswith("eval_") else \
                {"lw": 1, "color": "tab:orange" if key == "lr" else "tab:blue"}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=_LABELS.get(key, key), **style)
        if len(keys) > 1:
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def _number(value: object, log: Path, no: int, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KilnError(f"{log}:{no}: {key!r} is {value!r}, not a number")
    return float(value)
