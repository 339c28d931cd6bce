"""examples/agent: multi-turn GRPO on a number-guessing environment, on CPU, from a random tiny Qwen3.

Writes data/ (prompts, warm-up games, a byte-level BPE with TRL's Qwen2.5 chat template), runs `kiln train
sft.toml` (the format: a digit, then the end of the turn) and `kiln train agent.toml` (multi-turn GRPO against
guess_env.GuessEnv), prints the reward curve and draws runs/agent/curve.png."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from importlib import resources
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_data() -> None:
    from kiln.data.bpe import train_bpe
    from kiln.hub import ChatTemplate

    data = HERE / "data"
    data.mkdir(exist_ok=True)
    rng = random.Random(0)
    rows = [{"prompt": "I am thinking of a digit from 0 to 9. Guess it.", "target": rng.randrange(10)}
            for _ in range(512)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    chat = ChatTemplate(template)
    convs = [chat.render([{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": str(g)},
                          {"role": "user", "content": h}, {"role": "assistant", "content": "Say one digit."}])
             for r, g, h in zip(rows, range(10), ["higher", "lower"] * 5)]
    (data / "corpus.txt").write_text("\n".join(convs))
    # the warm-up's worked games: random guesses (the hints ignored), so SFT teaches the format, not the strategy
    games = []
    for _ in range(600):
        target, messages = rng.randrange(10), [{"role": "user", "content": rows[0]["prompt"]}]
        for _turn in range(3):
            guess = rng.randrange(10)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == target:
                break
            messages.append({"role": "user", "content": "higher" if guess < target else "lower"})
        if messages[-1]["role"] == "user":
            messages.pop()
        games.append({"messages": messages})
    (data / "sft.jsonl").write_text("".join(json.dumps(g) + "\n" for g in games))
    train_bpe([data / "corpus.txt"], data / "tok", vocab_size=320, min_frequency=1)
    cfg = json.loads((data / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (data / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))


def main() -> None:
    make_data()
    import os
    import shutil

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    for name in ("sft", "agent"):
        if (HERE / "runs" / name).exists():
            shutil.rmtree(HERE / "runs" / name)
        subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", str(HERE / f"{name}.toml")],
                       check=True, cwd=HERE, env=env)  # this checkout's kiln, whatever the venv has installed
    run = HERE / "runs" / "agent"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    print("step  reward/env  turns-limit  truncated  zero-std")
    for r in rows:
        print(f"{r['step']:4d}  {r['reward']:.3f}       {r['alarm/turn_limit']:.2f}         "
              f"{r['alarm/truncated']:.2f}       {r['alarm/zero_std_groups']:.2f}")
    k = max(1, len(rows) // 5)
    first, last = sum(r["reward"] for r in rows[:k]) / k, sum(r["reward"] for r in rows[-k:]) / k
    print(f"mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.figure(figsize=(5, 3))
        plt.plot([r["step"] for r in rows], [r["reward"] for r in rows])
        plt.xlabel("step")
        plt.ylabel("episode reward")
        plt.tight_layout()
        plt.savefig(run / "curve.png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
