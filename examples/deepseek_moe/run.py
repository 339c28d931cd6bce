"""A tiny DeepSeek-V3-shaped MoE model end to end on CPU:

  1. the BBC News token shards and tokenizer of examples/pretrain_bbc (built there if missing),
     and the chatterbot-corpus dialogs of examples/chatbot (its prepare.py)
  2. kiln train --config pretrain.toml   pre-training from scratch, [moe] aux-loss-free balancing
                                         and the depth-1 MTP loss
  3. kiln export                         an HF directory (the MTP layer under model.layers.4)
  4. kiln train --config sft.toml        LoRA SFT on the dialogs, aux-free balancing still on
  5. curves.png and expert_load.png beside this file, and the figures the README quotes

    .venv/bin/python examples/deepseek_moe/run.py            # both stages
    .venv/bin/python examples/deepseek_moe/run.py --control  # also a pre-training run with balance = "none"
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
LAYERS = (1, 2, 3, 4)  # the MoE layers: 1-3 of the main stack and the MTP layer (4)


def kiln(*args: str) -> None:
    print("$ kiln " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=HERE, check=True)


def make_data() -> None:
    bbc = HERE.parent / "pretrain_bbc"
    if not (bbc / "data" / "shards" / "manifest.json").is_file():
        spec = importlib.util.spec_from_file_location("pretrain_bbc_run", bbc / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.make_data()
    subprocess.run([sys.executable, str(HERE.parent / "chatbot" / "prepare.py")], check=True)


def records(run: str) -> list[dict]:
    lines = (HERE / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def plot(runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre, sft = runs["pretrain"], runs["sft"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in pre if "lm_loss" in r]
    a.plot(steps, [r["lm_loss"] for r in pre if "lm_loss" in r], label="LM loss (train)")
    a.plot(steps, [r["mtp_loss"] for r in pre if "mtp_loss" in r], label="MTP loss, t+2 (train)")
    a.plot([r["step"] for r in pre if "eval_loss" in r], [r["eval_loss"] for r in pre if "eval_loss" in r], "o-",
           label="LM loss (validation)")
    if "control" in runs:
        c = runs["control"]
        a.plot([r["step"] for r in c if "lm_loss" in r], [r["lm_loss"] for r in c if "lm_loss" in r], alpha=0.6,
               label='LM loss, balance = "none"')
    a.set(title="pre-training on BBC News (from scratch)", xlabel="step", ylabel="cross entropy")
    a.legend()
    b.plot([r["step"] for r in sft if "loss" in r], [r["loss"] for r in sft if "loss" in r], label="train")
    b.plot([r["step"] for r in sft if "eval_loss" in r], [r["eval_loss"] for r in sft if "eval_loss" in r], "o-",
           label="held-out dialogs")
    b.set(title="LoRA SFT on chatterbot dialogs", xlabel="step", ylabel="loss on assistant tokens")
    b.legend()
    fig.tight_layout()
    fig.savefig(HERE / "curves.png", dpi=90)

    shown = [(name, runs[name]) for name in ("pretrain", "control", "sft") if name in runs]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, (name, rs) in zip(axes[0], shown):
        rows = [r for r in rs if "moe_imbalance" in r]
        for layer in LAYERS:
            key = f"model.layers.{layer}"
            if f"moe_max_load.{key}" in rows[0]:
                ax.plot([r["step"] for r in rows], [r[f"moe_max_load.{key}"] / r[f"moe_mean_load.{key}"] for r in rows],
                        label=f"layer {layer}" + (" (MTP)" if layer == 4 else ""))
        title = {"pretrain": 'pre-training, balance = "aux_free"', "control": 'pre-training, balance = "none"',
                 "sft": 'LoRA SFT, balance = "aux_free"'}[name]
        ax.set(title=title, xlabel="step", ylabel="max / mean tokens per expert", ylim=(0.9, 4.1))
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "expert_load.png", dpi=90)


def summary(runs: dict[str, list[dict]]) -> None:
    for name, rs in runs.items():
        train = [r for r in rs if "lm_loss" in r or ("loss" in r and "eval_loss" not in r)]
        evals = [(r["step"], r["eval_loss"]) for r in rs if "eval_loss" in r]
        imb = [(r["step"], r["moe_imbalance"]) for r in rs if "moe_imbalance" in r]
        first, last = train[0], train[-1]
        print(f"\n{name}: loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})"
              + (f"; mtp_loss {first['mtp_loss']:.3f} -> {last['mtp_loss']:.3f}" if "mtp_loss" in last else ""))
        print("  eval_loss: " + ", ".join(f"{s}: {v:.3f}" for s, v in evals))
        peak = max(imb, key=lambda x: x[1])
        print(f"  moe_imbalance (max/mean, mean over layers): first {imb[0][1]:.2f}, peak {peak[1]:.2f} at step "
              f"{peak[0]}, last {imb[-1][1]:.2f}; mean of the last 10 logged {sum(v for _, v in imb[-10:]) / 10:.2f}")


def main(control: bool = False) -> None:
    make_data()
    shutil.rmtree(HERE / "runs", ignore_errors=True)
    kiln("train", "--config", "pretrain.toml")
    if control:
        kiln("train", "--config", "pretrain.toml", "--set", "moe.balance=none", "--set", "train.out_dir=runs/control",
             "--set", "train.eval_every=0", "--set", "train.save_every=0")
    last = sorted((HERE / "runs" / "pretrain").glob("ckpt-*"))[-1]
    kiln("export", "--checkpoint", str(last), "--out", "runs/base-model")
    kiln("train", "--config", "sft.toml")
    runs = {name: records(name) for name in ("pretrain", "control", "sft") if (HERE / "runs" / name).is_dir()}
    plot(runs)
    summary(runs)


if __name__ == "__main__":
    main(control="--control" in sys.argv[1:])
