"""Forward-Forward between backprop steps vs plain backprop, the same small Mamba on BBC News, on CPU:

  1. the BBC News tokenizer and token shards of examples/pretrain_bbc (built with its recipe if missing)
  2. kiln train bp.toml (40 backprop steps) and kiln train ff.toml (80 steps: every 4th backprops,
     the others move only the Mamba skip vectors D by the seed trainer's FF rule), side by side
  3. validation loss at equal backprop steps and at equal training time, the FF figures (hinge
     activity, how far D moved), and runs/curves.png

    .venv/bin/python examples/mamba_ff/run.py
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
PRETRAIN = HERE.parent / "pretrain_bbc"


def make_data() -> None:
    if (PRETRAIN / "data" / "shards" / "manifest.json").is_file():
        return
    spec = importlib.util.spec_from_file_location("pretrain_bbc_run", PRETRAIN / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_data()


def train_both(names: tuple[str, ...]) -> dict[str, tuple[list[dict], float]]:
    """kiln train each config at the same time: on a shared machine both then see the same load, so their
    training times compare."""
    procs = {}
    for name in names:
        shutil.rmtree(HERE / "runs" / name, ignore_errors=True)
        procs[name] = (subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "train", "--config", f"{name}.toml"],
                                        cwd=HERE), time.perf_counter())
    out = {}
    for name, (proc, start) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"kiln train --config {name}.toml failed ({proc.returncode})")
        rows = [json.loads(line) for line in (HERE / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = (rows, time.perf_counter() - start)
    return out


def train_seconds(rows: list[dict]) -> dict[int, float]:
    """Cumulative training time (evaluation left out) at each step, from each record's tokens / tokens_per_s."""
    total, out = 0.0, {}
    for r in rows:
        if r.get("tokens_per_s"):
            total += r["tokens"] / r["tokens_per_s"]
            out[r["step"]] = total
    return out


def at_time(evals: dict[int, float], seconds: dict[int, float], t: float) -> tuple[int, float]:
    """The evaluation whose training time is nearest to t: (step, validation loss)."""
    step = min(evals, key=lambda s: abs(seconds[s] - t))
    return step, evals[step]


def main() -> None:
    make_data()
    runs = train_both(("bp", "ff"))
    evals = {name: {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} for name, (rows, _) in runs.items()}
    seconds = {name: train_seconds(rows) for name, (rows, _) in runs.items()}
    steps = {name: [r for r in rows if "tokens_per_s" in r] for name, (rows, _) in runs.items()}
    ff_rows = steps["ff"]
    ff_only = [r for r in ff_rows if "conflict_layers" not in r]
    bp_in_ff = [r for r in ff_rows if "conflict_layers" in r]
    cadence = len(ff_rows) // max(len(bp_in_ff), 1)
    print("| run | step | backprop steps | training time | validation loss |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("bp", "ff"):
        for s, loss in evals[name].items():
            bps = s if name == "bp" else s // cadence
            print(f"| {name} | {s} | {bps} | {seconds[name][s]:.0f} s | {loss:.3f} |")
    print("equal backprop steps:")
    for s, loss in evals["ff"].items():
        if s // cadence in evals["bp"]:
            print(f"  {s // cadence}: ff (step {s}) {loss:.3f} vs bp {evals['bp'][s // cadence]:.3f}")
    print("equal training time (the bp evaluation nearest in time):")
    for s, loss in evals["ff"].items():
        b, bl = at_time(evals["bp"], seconds["bp"], seconds["ff"][s])
        print(f"  ff step {s} at {seconds['ff'][s]:.0f} s: {loss:.3f} vs bp step {b} at {seconds['bp'][b]:.0f} s: {bl:.3f}")
    active = sum(1 for r in ff_only if r["ff_loss"] > 0)
    moved = sum(r["lr"] * r["grad_norm"] for r in ff_only)  # |delta D| of one SGD step = ff_lr * |FF gradient|
    losses = [r["ff_loss"] for r in ff_only]
    print(f"FF-only steps: {len(ff_only)}; hinge active (ff_loss > 0) on {active}; ff_loss min {min(losses):.3f}, "
          f"mean {sum(losses) / len(losses):.3f}, max {max(losses):.3f}; D moved by {moved:.4f} in total "
          f"(sum of ff_lr * |FF gradient| over those steps); layers updated per step: "
          f"{sorted({r['ff_updates'] for r in ff_only})}")
    print(f"backprop steps of the ff run with a conflicting D gradient (of {len(bp_in_ff)}): "
          f"{[r['conflict_layers'] for r in bp_in_ff]}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("bp", "ff"):
        xs = list(evals[name])
        axes[0].plot([x if name == "bp" else x // cadence for x in xs], list(evals[name].values()), marker="o",
                     label=name)
        axes[1].plot([seconds[name][x] for x in xs], list(evals[name].values()), marker="o", label=name)
    axes[0].set_xlabel("backprop steps")
    axes[1].set_xlabel("training time (s)")
    for ax in axes:
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.savefig(HERE / "runs" / "curves.png", dpi=100, bbox_inches="tight")
    print(HERE / "runs" / "curves.png")


if __name__ == "__main__":
    main()
