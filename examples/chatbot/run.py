"""The chatbot example end to end, on CPU in a few minutes:

  1. chatterbot-corpus English dialogs -> chat JSONL (one category held out)
  2. kiln tokenizer train        (byte-level BPE + ChatML template)
  3. kiln train --config base.toml   (full SFT of a small Qwen3-shaped model from scratch)
  4. kiln export                 (an HF directory transformers can load)
  5. kiln train --config lora.toml   (LoRA on the held-out category)
  6. kiln export                 (LoRA merged into a plain HF directory)
and greedy replies to held-out questions before and after the LoRA stage.

    .venv/bin/python examples/chatbot/run.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def kiln(*args: str) -> None:
    print("$ kiln " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=HERE, check=True)


def losses(run: str) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (HERE / "runs" / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r and "step" in r]


def windows(points: list[tuple[int, float]], n: int = 8) -> str:
    """Mean loss over n equal windows of steps (one step's loss is noisy: rows differ in reply tokens)."""
    size = max(1, len(points) // n)
    parts = [points[i:i + size] for i in range(0, len(points), size)]
    return ", ".join(f"{p[0][0]}-{p[-1][0]}: {sum(v for _, v in p) / len(p):.3f}" for p in parts)


def evals(run: str) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (HERE / "runs" / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]


def replies(model_dir: Path, questions: list[str]) -> list[str]:
    import torch

    import kiln.engine  # noqa: F401  (model.generate runs on the generation engine)  # engfsdp
    from kiln.data.sft import chat_prompt_ids
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = []
    for q in questions:
        ids = torch.tensor([chat_prompt_ids(model.tokenizer, [{"role": "user", "content": q}])])
        new = model.generate(ids, max_new_tokens=32)[0, ids.size(1):]
        out.append(model.tokenizer.decode(new.tolist()).strip())
    return out


def last_ckpt(run: str) -> str:
    return str(sorted((HERE / "runs" / run).glob("ckpt-*"))[-1])


def main() -> None:
    subprocess.run([sys.executable, str(HERE / "prepare.py")], check=True)
    kiln("tokenizer", "train", "data/tokenizer_text.jsonl", "--out", "runs/tok", "--vocab-size", "2048")
    kiln("train", "--config", "base.toml")
    kiln("export", "--checkpoint", last_ckpt("base"), "--out", "runs/base-model")
    held = [json.loads(x)["messages"] for x in (HERE / "data" / "held_eval.jsonl").read_text().splitlines()][:6]
    questions = [c[0]["content"] for c in held]
    before = replies(HERE / "runs" / "base-model", questions)
    kiln("train", "--config", "lora.toml")
    kiln("export", "--checkpoint", last_ckpt("lora"), "--out", "runs/lora-merged")
    after = replies(HERE / "runs" / "lora-merged", questions)

    base_loss, lora_loss = losses("base"), losses("lora")
    print("\nstage 1 (full SFT) mean train loss by steps:", windows(base_loss))
    print("stage 2 (LoRA) mean train loss by steps:    ", windows(lora_loss, 6))
    print("stage 2 held-out eval loss:", ", ".join(f"{s}:{v:.3f}" for s, v in evals("lora")))
    for q, c, b, a in zip(questions, held, before, after):
        print(f"\nQ: {q}\n   reference: {c[1]['content']}\n   base:      {b}\n   +LoRA:     {a}")


if __name__ == "__main__":
    main()
