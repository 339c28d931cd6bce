"""Turn the English dialogs of the PyPI package chatterbot-corpus into chat JSONL for kiln.

Each YAML conversation alternates user / assistant turns. One category ("psychology" by default) is
held out of pre-training: it becomes the LoRA data (train + eval) of the second stage.
Writes data/base.jsonl, data/held_train.jsonl, data/held_eval.jsonl, data/tokenizer_text.jsonl.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import chatterbot_corpus
import yaml

HERE = Path(__file__).parent


def conversations(path: Path) -> list[list[dict[str, str]]]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    out = []
    for conv in data.get("conversations") or []:
        turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
        if len(turns) < 2:
            continue
        turns = turns[: len(turns) // 2 * 2]  # end on an assistant turn
        out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)])
    return out


def main(held_out: str = "psychology") -> None:
    src = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    base, held = [], []
    for f in sorted(src.glob("*.yml")):
        (held if f.stem == held_out else base).extend(conversations(f))
    rng = random.Random(0)
    rng.shuffle(held)
    n_eval = max(4, len(held) // 5)
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    for name, rows in (("base", base), ("held_train", held[n_eval:]), ("held_eval", held[:n_eval])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    # the tokenizer sees every text (the LoRA category included), as a tokenizer trained on the full corpus would
    (out / "tokenizer_text.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in base + held))
    print(f"{len(base)} base conversations from {len(list(src.glob('*.yml'))) - 1} categories; "
          f"held out {held_out!r}: {len(held) - n_eval} train, {n_eval} eval")


if __name__ == "__main__":
    main(*sys.argv[1:])
