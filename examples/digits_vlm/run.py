"""A tiny image-text model trained on half of a task, then LoRA-tuned to all of it, on CPU, with scikit-learn's
bundled handwritten digits.

  1. data/: the 1,797 bundled 8x8 digits as PNGs; a fixed 297 (seed 0) are held out and never trained on, by
     either stage. A byte-level tokenizer (no merges) with the ChatML and vision tokens (262 ids).
  2. kiln train base.toml (stage 1, every weight, from scratch): a Qwen3.5-shaped image-text model learns
     "Which digit is this?" on the 0-4s among the 1,500 training digits; it never sees a 5-9. kiln export:
     the base model.
  3. Held-out accuracy of the base asked "Which digit is this?" about every held-out digit.
  4. kiln train lora.toml (stage 2): LoRA adapters on that base (the language model's, the vision tower's and
     the patch merger's Linears; every base weight frozen) learn "Which digit is this?" about all ten digits.
  5. Held-out accuracy after: the adapter checkpoint (base + adapters) answers every held-out image greedily;
     runs/curves.png: both stages' train and held-out loss.

    .venv/bin/python examples/digits_vlm/run.py                                  # the whole example
    .venv/bin/python examples/digits_vlm/run.py --out DIR --steps 2,2 --train 40 --held 8  # the plumbing
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION = "Which digit is this?"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # ids 3, 4, 5 (base.toml's)
HELD_FROM = 1500                                   # the permutation's first 1,500 digits train, the rest are held out
SEEN = range(5)                                    # the digits stage 1 sees; stage 2 teaches 5-9 as well


def chat(image: str, digit: int | None = None) -> dict:
    user = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}
    return {"messages": [user] + ([{"role": "assistant", "content": str(digit)}] if digit is not None else [])}


def make_data(data: Path, n_train: int | None = None, n_held: int | None = None) -> list[tuple[str, int]]:
    """Writes data/ (images, each stage's train and held-out rows, the tokenizer); returns the held-out pairs.
    `n_train` / `n_held`: only the first so many of each (a quick check)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from kiln.data.bpe import train_bpe

    digits = load_digits()
    images = (digits.images * (255 / 16)).round().astype(np.uint8)  # 0..16 grey levels -> 0..255
    order = np.random.default_rng(0).permutation(len(images))
    (data / "images").mkdir(parents=True, exist_ok=True)
    train = [(f"images/{i}.png", int(digits.target[i])) for i in order[:HELD_FROM]][:n_train]
    held = [(f"images/{i}.png", int(digits.target[i])) for i in order[HELD_FROM:]][:n_held]
    for name, _ in train + held:
        Image.fromarray(images[int(name[7:-4])], mode="L").save(data / name)
    seen = [(name, d) for name, d in train if d in SEEN], [(name, d) for name, d in held if d in SEEN]
    for file, pairs in (("base_train", seen[0]), ("base_eval", seen[1]), ("lora_train", train), ("lora_eval", held)):
        rows = [chat(name, d) for name, d in pairs]
        (data / f"{file}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (data / "text.txt").write_text(QUESTION + "\n0123456789\n", encoding="utf-8")
    train_bpe([data / "text.txt"], data / "tok", vocab_size=262, min_frequency=1, extra_special_tokens=VISION_TOKENS)
    return held


def kiln(work: Path, *args: str) -> float:
    """Runs `kiln ARGS` in `work`; returns its wall-clock seconds."""
    print("$ kiln " + " ".join(args), flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=work, check=True)
    return time.perf_counter() - start


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_ckpt(run: Path) -> Path:
    return max(run.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1]))


def replies(model_dir: Path, data: Path, held: list[tuple[str, int]]) -> list[str]:
    """Greedy replies (up to EOS, 3 tokens at most) of the model in `model_dir` (an HF directory, or a LoRA
    checkpoint: the base's path and the adapters) to the question about each held-out image, in one batch."""
    import torch

    import kiln.engine  # noqa: F401  (model.generate runs on the generation engine)  # engfsdp
    from kiln.data.sft import image_chat_prompt
    from kiln.models import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    spec = model.image_tokens(model_dir=model_dir, root=data)  # the processor the run trained with
    prompts, pixels, grids = [], [], []
    for name, _ in held:
        ids, inputs = image_chat_prompt(model.tokenizer, chat(name)["messages"], spec)
        prompts.append(ids)
        pixels.append(inputs["pixel_values"])
        grids.append(inputs["image_grid_thw"])
    assert len({len(p) for p in prompts}) == 1  # one image size, one question: one batch, no padding
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, prompt_inputs={"pixel_values": torch.cat(pixels),
                                                                   "image_grid_thw": torch.cat(grids)})
    return [model.tokenizer.decode(row[ids.shape[1]:].tolist(), skip_special_tokens=True).strip() for row in out]


def accuracy(model_dir: Path, data: Path, held: list[tuple[str, int]]) -> dict[str, float]:
    """Share of held-out digits whose greedy reply is exactly the digit: all, the 0-4s, the 5-9s."""
    right = [(r == str(d), d in SEEN) for r, (_, d) in zip(replies(model_dir, data, held), held)]
    share = lambda hits: sum(hits) / max(1, len(hits))  # noqa: E731
    return {"all": share([h for h, _ in right]), "0-4": share([h for h, s in right if s]),
            "5-9": share([h for h, s in right if not s])}


def table(rows: list[dict], every: int) -> list[str]:
    """Markdown rows: the train loss every `every` steps and each evaluation's held-out loss."""
    out = ["| step | loss | eval_loss |", "| --- | --- | --- |"]
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
    for step, r in sorted(by_step.items()):
        if "eval_loss" in r or ("loss" in r and step % every == 0):
            loss, ev = r.get("loss"), r.get("eval_loss")
            out.append(f"| {step} | {'' if loss is None else f'{loss:.3f}'} | {'' if ev is None else f'{ev:.3f}'} |")
    return out


def plot(base: list[dict], lora: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, rows, title in ((axes[0], base, "stage 1: every weight, digits 0-4"),
                            (axes[1], lora, "stage 2: LoRA, digits 0-9")):
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train), label="train loss", lw=1)
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out loss")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="working folder (data/, runs/); default: this folder")
    p.add_argument("--steps", default=None, help="'STAGE1,STAGE2' steps instead of the configs' (a quick check)")
    p.add_argument("--train", type=int, default=None, help="train on only the first N training digits")
    p.add_argument("--held", type=int, default=None, help="use only the first N held-out digits")
    args = p.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if work != HERE:
        for name in ("base.toml", "lora.toml"):
            shutil.copy(HERE / name, work / name)
    quick = ["--set=train.warmup_steps=0", "--set=train.eval_every=0", "--set=train.eval_batches=1",
             "--set=train.batch_size=2"]
    steps = [[f"--set=train.steps={s}", *quick] for s in args.steps.split(",")] if args.steps else [[], []]
    data, runs = work / "data", work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    held = make_data(data, args.train, args.held)

    seconds = {"stage 1": kiln(work, "train", "--config", "base.toml", *steps[0])}
    seconds["export"] = kiln(work, "export", "--checkpoint", str(last_ckpt(runs / "base")), "--out", "runs/base-model")
    result = {"base": accuracy(runs / "base-model", data, held)}
    print("held-out accuracy of the base:", result["base"], flush=True)
    seconds["stage 2"] = kiln(work, "train", "--config", "lora.toml", *steps[1])
    adapters = last_ckpt(runs / "lora") / "model"  # adapter_config.json names the base; loaded as one model
    result["base + LoRA"] = accuracy(adapters, data, held)

    base_rows, lora_rows = metrics(runs / "base"), metrics(runs / "lora")
    plot(base_rows, lora_rows, runs / "curves.png")
    print("\nstage 1 (every weight, from scratch, digits 0-4):", *table(base_rows, 50), sep="\n")
    print("\nstage 2 (LoRA, digits 0-9):", *table(lora_rows, 25), sep="\n")
    print(f"\nheld-out accuracy ({len(held)} digits never trained on, greedy replies to {QUESTION!r}):")
    print("| model | all | 0-4 | 5-9 |", "| --- | --- | --- | --- |", sep="\n")
    for what, acc in result.items():
        print(f"| {what} | {acc['all']:.3f} | {acc['0-4']:.3f} | {acc['5-9']:.3f} |")
    print("seconds:", ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), f"(curves: {runs / 'curves.png'})")
    return {"accuracy": result, "adapters": adapters, "seconds": seconds}


if __name__ == "__main__":
    main()
