"""`kiln plot RUN_DIR`: loss, learning rate and eval curves from metrics.jsonl, as one PNG."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError
from kiln.hub.jsonio import iter_jsonl


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write RUN_DIR/curves.png (or `out`): training loss, lr, and every eval_* metric by step."""
    run_dir = Path(run_dir)
    log = run_dir / "metrics.jsonl"
    records = [r for _, r, _ in iter_jsonl(log, torn_tail=True)] if log.is_file() else []
    if not records:
        raise KilnError(f"{run_dir}: no metrics.jsonl records to plot")
    try:
        import matplotlib
    except ImportError:
        raise KilnError("kiln plot needs matplotlib: pip install 'kiln[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval_")})
    panels = 2 + len(eval_keys)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    axes[0].set_title("train loss")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train], lw=1, color="tab:orange")
    axes[1].set_title("learning rate")
    for ax, key in zip(axes[2:], eval_keys):
        pts = [(r["step"], r[key]) for r in evals if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="tab:green")
        ax.set_title(key)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_path = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
