"""The preference example end to end, on CPU:

  1. chatterbot-corpus dialogs -> SFT chat JSONL and preference pairs (prepare.py)
  2. kiln tokenizer train            (byte-level BPE + ChatML template)
  3. kiln train --config sft.toml    (full SFT of a small Qwen3-shaped model from scratch)
  4. kiln export                     (the SFT model as an HF directory)
  5. kiln train --config dpo.toml    (DPO against the SFT model, reference log-probs precomputed)
and the held-out reward accuracy and margins as DPO goes, plus the train reward curve; last, the held-out
metric that needs no reference: the share of held-out pairs whose real reply the model itself prefers,
before (the SFT model) and after DPO.

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


def preference_accuracy(model_dir: Path, pairs: Path, max_length: int = 64) -> float:
    """Share of held-out pairs whose real reply the model itself prefers: its summed log-prob of `chosen` above
    that of `rejected` (no reference involved), tokenized as the dpo recipe tokenizes them."""
    import torch

    from kiln.data import read_records
    from kiln.data.loader import pad_collate
    from kiln.data.preference import encode_preferences
    from kiln.models import AutoModelForCausalLM
    from kiln.train.packing import layout_logps
    from kiln.train.recipes.dpo import pair_layout

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples, _ = encode_preferences(read_records(pairs), model.tokenizer, max_length)
    right = 0
    with torch.no_grad():
        for s in range(0, len(examples), 32):
            layout = pair_layout(pad_collate(examples[s:s + 32]), pack=model.packs_samples())
            total, n = layout.per_sequence(layout_logps(model, layout, "comp")), layout.n // 2
            right += int((total[:n] > total[n:]).sum())
    return right / len(examples)


def main() -> None:
    shutil.rmtree(HERE / "runs", ignore_errors=True)  # a fresh run each time (run dirs refuse reuse)
    subprocess.run([sys.executable, str(HERE / "prepare.py")], check=True)
    kiln("tokenizer", "train", "data/tokenizer_text.jsonl", "--out", "runs/tok", "--vocab-size", "1024")
    kiln("train", "--config", "sft.toml")
    ckpt = sorted((HERE / "runs" / "sft").glob("ckpt-*"))[-1]
    kiln("export", "--checkpoint", str(ckpt), "--out", "runs/sft-model")
    kiln("train", "--config", "dpo.toml")
    dpo_ckpt = sorted((HERE / "runs" / "dpo").glob("ckpt-*"))[-1] / "model"
    held = HERE / "data" / "pairs_eval.jsonl"
    before, after = preference_accuracy(HERE / "runs" / "sft-model", held), preference_accuracy(dpo_ckpt, held)
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
    print(f"held-out pairs whose real reply the model prefers (summed log-prob, no reference): "
          f"SFT model {before:.3f} -> DPO model {after:.3f}")


if __name__ == "__main__":
    main()
