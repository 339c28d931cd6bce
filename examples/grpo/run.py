"""GRPO on arithmetic with real answers, on CPU: SFT a tiny Qwen3 on worked sums, then RL with an exact-match reward.

  1. data/: sums a + b (a, b in 0..29); a fixed fifth of the pairs is held out. SFT rows (chat messages,
     question -> answer) and GRPO prompts (the question as a message list, the true sum in `answer`) come from
     the other pairs; data/heldout.jsonl holds the held-out questions. A byte-level BPE tokenizer (300 ids).
  2. kiln train sft.toml: a tiny Qwen3 from scratch learns the format and some of the sums.
  3. kiln train grpo.toml: GRPO from the SFT checkpoint, reward = exact_match (the completion equals the sum),
     8 completions per prompt; eval_reward = held-out accuracy of greedy answers every 10 steps.
  4. held-out accuracy of greedy answers before (the SFT model) and after (the GRPO model), computed here
     independently of the trainer; the reward curve in runs/curves.png.

    .venv/bin/python examples/grpo/run.py
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
N = 10  # operands 0..N-1: single digits


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_data() -> list[tuple[int, int]]:
    """Writes data/ and returns the held-out pairs."""
    from kiln.data.bpe import train_bpe

    pairs = [(a, b) for a in range(N) for b in range(N)]
    rng = random.Random(0)
    rng.shuffle(pairs)
    held, train = pairs[: len(pairs) // 5], pairs[len(pairs) // 5:]
    DATA.mkdir(exist_ok=True)

    def write(name: str, rows: list[dict]) -> None:
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    write("sft.jsonl", [{"messages": [{"role": "user", "content": question(a, b)},
                                      {"role": "assistant", "content": str(a + b)}]} for a, b in train])
    write("prompts.jsonl", [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}
                            for a, b in train])
    write("heldout.jsonl", [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}
                            for a, b in held])
    write("text.jsonl", [{"text": f"{question(a, b)}{a + b}"} for a, b in pairs])
    train_bpe([DATA / "text.jsonl"], DATA / "tok", vocab_size=259, min_frequency=1)  # bytes only: no merges
    return held


def train(name: str) -> list[dict]:
    shutil.rmtree(HERE / "runs" / name, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", f"{name}.toml"], cwd=HERE, check=True)
    return [json.loads(line) for line in (HERE / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def newest(run: Path) -> Path:
    return max(run.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1])) / "model"


def accuracy(model_dir: Path, held: list[tuple[int, int]]) -> float:
    """Share of held-out sums whose greedy answer (chat template, up to EOS) is exactly right."""
    import torch

    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok, template = model.tokenizer, model.tokenizer.chat()
    right = 0
    for a, b in held:
        text = template.render([{"role": "user", "content": question(a, b)}], add_generation_prompt=True)
        ids = torch.tensor([tok.backend.encode(text, add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=6)
        right += tok.decode(out[0, ids.size(1):].tolist(), skip_special_tokens=True).strip() == str(a + b)
    return right / len(held)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="train reward (sampled, T = 1)")
    ax.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "runs" / "curves.png", dpi=100)


def main() -> None:
    held = make_data()
    train("sft")
    before = accuracy(newest(HERE / "runs" / "sft"), held)  # the model grpo.toml starts from
    rows = train("grpo")
    after = accuracy(newest(HERE / "runs" / "grpo"), held)
    plot(rows)
    print("| step | reward (train, sampled) | reward_std | completion_length | held-out accuracy (greedy) |")
    print("| --- | --- | --- | --- | --- |")
    evals = {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}
    for r in rows:
        if "reward" in r and (r["step"] % 10 == 0 or r["step"] == 1):
            print(f"| {r['step']} | {r['reward']:.3f} | {r['reward_std']:.3f} | {r['completion_length']:.2f} | "
                  f"{evals.get(r['step'], float('nan')):.3f} |")
    print(f"held-out accuracy ({len(held)} sums never trained on): before GRPO {before:.3f}, after {after:.3f}")


if __name__ == "__main__":
    main()
