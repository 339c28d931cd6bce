"""chatterbot-corpus English dialogs -> SFT chat JSONL and DPO preference pairs.

Every dialog's first turn is a prompt and its second turn the real reply. The SFT stage learns the
replies (data/sft.jsonl). The DPO pairs keep the real reply as `chosen` and take as `rejected` the reply
of a dialog from another category; every fifth dialog is held out (data/pairs_eval.jsonl), so the
held-out reward accuracy measures pairs the model never saw. Writes data/sft.jsonl, data/pairs_train.jsonl,
data/pairs_eval.jsonl, data/tokenizer_text.jsonl.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import chatterbot_corpus
import yaml

HERE = Path(__file__).parent


def dialogs() -> list[tuple[str, str, str]]:
    """(category, first turn, reply) of every English dialog with a reply."""
    src = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    out = []
    for f in sorted(src.glob("*.yml")):
        for conv in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
            if len(turns) >= 2:
                out.append((f.stem, turns[0], turns[1]))
    return out


def main() -> None:
    rng = random.Random(0)
    all_dialogs = dialogs()
    rows = []
    for cat, prompt, reply in all_dialogs:
        other = rng.choice([d for d in all_dialogs if d[0] != cat])
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": reply}],
                     "rejected": [{"role": "assistant", "content": other[2]}]})
    train, held = [r for i, r in enumerate(rows) if i % 5], rows[::5]
    out = HERE / "data"
    out.mkdir(exist_ok=True)

    def write(name: str, items: list[dict]) -> None:
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in items))

    write("sft.jsonl", [{"messages": r["prompt"] + r["chosen"]} for r in train])
    write("pairs_train.jsonl", train)
    write("pairs_eval.jsonl", held)
    write("tokenizer_text.jsonl", [{"messages": r["prompt"] + r["chosen"]} for r in rows])
    print(f"{len(all_dialogs)} dialogs: {len(train)} train pairs, {len(held)} held-out pairs")


if __name__ == "__main__":
    main()
