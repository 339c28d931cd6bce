"""A tiny image-text model learns scikit-learn's handwritten digits as chats, on CPU.

  1. data/: the 1,797 bundled 8x8 digits as PNGs; a fixed 297 (seed 0) are held out. Each training row is a
     chat: the user shows the image and asks "what digit is this?", the assistant answers the digit.
     A byte-level tokenizer (no merges) with the ChatML and vision tokens (262 ids).
  2. kiln train sft.toml: a Qwen3.5-shaped image-text model from scratch (vision tower of 2 blocks, patch
     merger, a DeltaNet layer and an attention layer), packed rows with their images, loss on the replies.
  3. Held-out accuracy: the newest checkpoint answers every held-out image greedily (one batch, the chat
     template's generation prompt, kiln's generate with the images); a reply counts when it is the digit.

    .venv/bin/python examples/digits_vlm/run.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
QUESTION = "what digit is this?"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # ids 3, 4, 5 (sft.toml's)


def chat(image: str, digit: int | None = None) -> dict:
    user = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}
    return {"messages": [user] + ([{"role": "assistant", "content": str(digit)}] if digit is not None else [])}


def make_data() -> list[tuple[str, int]]:
    """Writes data/ and returns the held-out (image path, digit) pairs."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from kiln.data.bpe import train_bpe

    digits = load_digits()
    images = (digits.images * (255 / 16)).round().astype(np.uint8)  # 0..16 grey levels -> 0..255
    order = np.random.default_rng(0).permutation(len(images))
    (DATA / "images").mkdir(parents=True, exist_ok=True)
    train, held = [], []
    for n, i in enumerate(order):
        name = f"images/{i}.png"
        Image.fromarray(images[i], mode="L").save(DATA / name)
        (held if n >= 1500 else train).append((name, int(digits.target[i])))
    for file, rows in (("train.jsonl", train), ("eval.jsonl", held)):
        (DATA / file).write_text("".join(json.dumps(chat(name, d)) + "\n" for name, d in rows), encoding="utf-8")
    (DATA / "text.txt").write_text(QUESTION + "\n0123456789\n", encoding="utf-8")
    train_bpe([DATA / "text.txt"], DATA / "tok", vocab_size=262, min_frequency=1, extra_special_tokens=VISION_TOKENS)
    return held


def train() -> list[dict]:
    shutil.rmtree(HERE / "runs" / "sft", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", "sft.toml"], cwd=HERE, check=True)
    return [json.loads(line) for line in (HERE / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]


def accuracy(model_dir: Path, held: list[tuple[str, int]]) -> float:
    """Share of held-out digits whose greedy reply (up to EOS) is exactly the digit."""
    import torch

    from kiln.data.sft import image_chat_prompt
    from kiln.models import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    spec = model.image_tokens(model_dir=model_dir, root=DATA)  # the processor the run trained with
    prompts, pixels, grids = [], [], []
    for name, _ in held:
        ids, inputs = image_chat_prompt(model.tokenizer, chat(name)["messages"], spec)
        prompts.append(ids)
        pixels.append(inputs["pixel_values"])
        grids.append(inputs["image_grid_thw"])
    assert len({len(p) for p in prompts}) == 1  # one image size, one question: one batch, no padding
    ids = torch.tensor(prompts)
    out = model.generate(ids, max_new_tokens=3, prompt_inputs={"pixel_values": torch.cat(pixels),
                                                              "image_grid_thw": torch.cat(grids)})
    replies = [model.tokenizer.decode(row[ids.shape[1]:].tolist(), skip_special_tokens=True).strip() for row in out]
    return sum(r == str(d) for r, (_, d) in zip(replies, held)) / len(held)


def main() -> None:
    held = make_data()
    rows = train()
    model = max((HERE / "runs" / "sft").glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1])) / "model"
    acc = accuracy(model, held)
    print("| step | loss | eval_loss |")
    print("| --- | --- | --- |")
    for r in rows:
        if "eval_loss" in r or ("loss" in r and r["step"] % 50 == 0):
            print(f"| {r['step']} | {r.get('loss', float('nan')):.3f} | {r.get('eval_loss', float('nan')):.3f} |")
    print(f"held-out accuracy ({len(held)} digits never trained on, greedy replies): {acc:.3f}")


if __name__ == "__main__":
    main()
