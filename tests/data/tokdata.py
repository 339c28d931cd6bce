"""Helpers for the token-shard tests (a module of its own: every test folder's conftest is named `conftest`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from kiln.data.shards import ShardWriter, write_manifest
from tests.kiln_cli import kiln  # noqa: F401  (re-exported for the tests here)

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "past", "red", "houses", "and", "blue", "cars", "in", "the", "rain;", "birds", "flew", "over", "green", "trees", "near", "quiet", "water"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


def make_tokenizer_dir(path: Path, vocab_size: int = 300) -> Path:
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(make_docs(200, 1), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def write_synthetic_shards(root: Path, lengths: list[int], val_lengths: list[int] = (), eos_id: int = 0,
                           dtype: str = "uint32") -> Path:
    """Shards whose token at global position p is p + 1 (every token unique), documents of 7 tokens.

    The unique values let a test tell exactly which tokens a window holds; `eos_id` 0 never
    appears except where a document ends (every 7th token is replaced by it)."""
    root.mkdir(parents=True, exist_ok=True)
    splits, start = {}, 1
    for split, lens in (("train", lengths), ("val", val_lengths)):
        w = ShardWriter(root, split, dtype, shard_tokens=1 << 40)
        for n in lens:
            toks = np.arange(start, start + n, dtype=np.int64)
            toks[6::7] = eos_id
            start += n
            w.add(toks)
            w.flush()
        splits[split] = w.summary()
    write_manifest(root, {"dtype": dtype, "vocab_size": start + 1, "eos_id": eos_id, "eos_token": "<eos>",
                          "tokenizer": {"source": "synthetic", "sha256": "0" * 64, "vocab_size": start + 1},
                          "splits": splits, "documents": 0})
    return root


