"""examples/agent: multi-turn GRPO on a number-guessing environment, on CPU, from a random tiny Qwen3.

Writes data/ (prompts, warm-up games, a byte-level BPE with TRL's Qwen2.5 chat template), runs `kiln train
sft.toml` (the warm-up: the format, a digit then the end of the turn, and guesses the hints allow) and `kiln
train agent.toml` (multi-turn GRPO against guess_env.GuessEnv), prints the reward curve and draws
runs/agent/curve.png. `--root DIR` runs it in DIR (the configs and the environment copied there);
`--sft-steps` / `--grpo-steps` shorten it (tests/train/test_agent_example.py runs it so)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from importlib import resources
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_data(root: Path) -> None:
    from kiln.data.bpe import train_bpe
    from kiln.hub import ChatTemplate

    data = root / "data"
    data.mkdir(exist_ok=True)
    rng = random.Random(0)
    # the secret is 2 or 7 (the prompt does not say so): what GRPO has to find out by playing
    rows = [{"prompt": "I am thinking of a digit from 0 to 9. Guess it.", "target": rng.choice([2, 7])}
            for _ in range(512)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    chat = ChatTemplate(template)
    convs = [chat.render([{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": str(g)},
                          {"role": "user", "content": h}, {"role": "assistant", "content": "Say one digit."}])
             for r, g, h in zip(rows, range(10), ["higher", "lower"] * 5)]
    (data / "corpus.txt").write_text("\n".join(convs))
    # the warm-up's worked games: any secret digit, each guess at random among the digits the hints so far allow
    # (the format and the rule of the game, not where the secret is: that is what GRPO has to find)
    games = []
    for _ in range(600):
        target, messages = rng.randrange(10), [{"role": "user", "content": rows[0]["prompt"]}]
        lo, hi = 0, 9
        for _turn in range(3):
            guess = rng.randint(lo, hi)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == target:
                break
            lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)
            messages.append({"role": "user", "content": "higher" if guess < target else "lower"})
        if messages[-1]["role"] == "user":
            messages.pop()
        games.append({"messages": messages})
    (data / "sft.jsonl").write_text("".join(json.dumps(g) + "\n" for g in games))
    train_bpe([data / "corpus.txt"], data / "tok", vocab_size=320, min_frequency=1)
    cfg = json.loads((data / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (data / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))


def main(argv: list[str] | None = None) -> list[dict]:
    import argparse
    import os
    import shutil

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=HERE)
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--grpo-steps", type=int, default=None)
    args = ap.parse_args(argv)
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if root != HERE:
        for name in ("sft.toml", "agent.toml", "guess_env.py"):
            shutil.copy(HERE / name, root / name)
    make_data(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    for name, steps in (("sft", args.sft_steps), ("agent", args.grpo_steps)):
        if (root / "runs" / name).exists():
            shutil.rmtree(root / "runs" / name)
        cmd = [sys.executable, "-m", "kiln.cli.main", "train", "--config", str(root / f"{name}.toml")]
        if steps is not None:
            cmd += ["--set", f"train.steps={steps}"]
        if name == "agent" and args.sft_steps is not None:
            cmd += ["--set", f"model.path={root}/runs/sft/ckpt-{args.sft_steps:06d}/model"]
        subprocess.run(cmd, check=True, cwd=root, env=env)  # this checkout's kiln, whatever the venv has installed
    run = root / "runs" / "agent"
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
    return rows


if __name__ == "__main__":
    main()
