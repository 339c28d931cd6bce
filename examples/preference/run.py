"""The preference example end to end, on CPU:

  1. chatterbot-corpus dialogs -> SFT chat JSONL and preference pairs (prepare.py)
  2. kiln tokenizer train            (byte-level BPE + ChatML template)
  3. kiln train --config sft.toml    (full SFT of a small Qwen3-shaped model from scratch)
  4. kiln export                     (the SFT model as an HF directory)
  5. kiln train --config dpo.toml    (DPO against the SFT model, reference log-probs precomputed)
and the held-out reward accuracy and margins as DPO goes, plus the train reward curve.

    .venv/bin/python examples/preference/run.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def kiln(*args: str) -> None:
    print("$ kiln " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=HERE, check=True)


def records(run: str) -> list[dict]:
    return [json.loads(x) for x in (HERE / "runs" / run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def main() -> None:
    shutil.rmtree(HERE / "runs", ignore_errors=True)  # a fresh run each time (run dirs refuse reuse)
    subprocess.run([sys.executable, str(HERE / "prepare.py")], check=True)
    kiln("tokenizer", "train", "data/tokenizer_text.jsonl", "--out", "runs/tok", "--vocab-size", "1024")
    kiln("train", "--config", "sft.toml")
    ckpt = sorted((HERE / "runs" / "sft").glob("ckpt-*"))[-1]
    kiln("export", "--checkpoint", str(ckpt), "--out", "runs/sft-model")
    kiln("train", "--config", "dpo.toml")
    sft = [(r["step"], r["loss"]) for r in records("sft") if "loss" in r]
    print("\nSFT train loss:", ", ".join(f"{s}:{v:.3f}" for s, v in sft[::4]))
    train = [r for r in records("dpo") if "loss" in r]
    size = max(1, len(train) // 6)
    for i in range(0, len(train), size):
        part = train[i:i + size]
        mean = {k: sum(r[k] for r in part) / len(part) for k in ("loss", "rewards/accuracy", "rewards/margins")}
        print(f"DPO steps {part[0]['step']}-{part[-1]['step']}: loss {mean['loss']:.3f}, reward accuracy "
              f"{mean['rewards/accuracy']:.3f}, margin {mean['rewards/margins']:.3f}")
    for r in records("dpo"):
        if "eval_rewards/accuracy" in r:
            print(f"held-out at step {r['step']}: reward accuracy {r['eval_rewards/accuracy']:.3f}, margin "
                  f"{r['eval_rewards/margins']:.3f}, eval loss {r['eval_loss']:.3f}")


if __name__ == "__main__":
    main()
