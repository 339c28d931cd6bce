"""Forward-Forward between backprop steps vs plain backprop, the same small Mamba on BBC News, on CPU:

  1. the BBC News tokenizer and token shards of examples/pretrain_bbc (built with its recipe if missing)
  2. kiln train bp.toml (120 backprop steps) and kiln train ff.toml (120 steps: every 4th backprops,
     the others move only the Mamba skip vectors D by the FF goodness contrast)
  3. the held-out curves of both, a table, and runs/curves.png

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


def train(name: str) -> tuple[list[dict], float]:
    shutil.rmtree(HERE / "runs" / name, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", f"{name}.toml"], cwd=HERE, check=True)
    rows = [json.loads(line) for line in (HERE / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - start


def main() -> None:
    make_data()
    runs = {name: train(name) for name in ("bp", "ff")}
    evals = {name: {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} for name, (rows, _) in runs.items()}
    steps = sorted(evals["bp"])
    print("| validation loss, step | " + " | ".join(map(str, steps)) + " | wall |")
    print("| --- |" + " --- |" * (len(steps) + 1))
    for name, (rows, wall) in runs.items():
        backprops = sum(1 for r in rows if "grad_norm" in r)
        print(f"| {name} ({backprops} backprop steps) | " + " | ".join(f"{evals[name][s]:.3f}" for s in steps)
              + f" | {wall:.0f} s |")
    ff_rows = runs["ff"][0]
    ff = [r["ff_loss"] for r in ff_rows if "ff_loss" in r]
    conflicts = [r["conflict_layers"] for r in ff_rows if "conflict_layers" in r]
    print(f"ff_loss: first {ff[0]:.4f}, last {ff[-1]:.4f}, mean {sum(ff) / len(ff):.4f}; "
          f"backprop steps with a conflicting D gradient: {sum(1 for c in conflicts if c)} of {len(conflicts)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (rows, _) in runs.items():
        train_rows = [r for r in rows if "loss" in r and "eval_loss" not in r]
        ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], alpha=0.4, label=f"{name} train")
        ax.plot(list(evals[name]), list(evals[name].values()), marker="o", label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss")
    ax.legend()
    fig.savefig(HERE / "runs" / "curves.png", dpi=100, bbox_inches="tight")
    print(HERE / "runs" / "curves.png")


if __name__ == "__main__":
    main()
