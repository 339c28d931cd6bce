"""Recipes read the process's rank from the World they are given (kiln.parallel.world), not from the
environment: the pretrain recipe's loader reads that rank's share of the token stream."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.parallel.world import World
from kiln.train.config import parse_run_config
from kiln.train.recipes import RECIPES

VOCAB = 64


def _cfg(ids, **parallel):
    return parse_run_config({
        "model": {"family": "qwen3", "task": "causal-lm",
                  "config": {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                             "max_position_embeddings": 64, "eos_token_id": 0}},
        "data": {"train": str(ids), "max_length": 8},
        "train": {"steps": 1, "batch_size": 2},
        "parallel": parallel})


@pytest.mark.parametrize("world, parallel, want", [
    (World(rank=1, size=2), {}, (1, 2)),              # plain data parallel: its own share
    (World(rank=0, size=2), {}, (0, 2)),
    (World(rank=3, size=4), {"tp": 2}, (1, 2)),       # tp ranks of one group read the same rows
    (World(), {}, (0, 1)),
])
def test_the_pretrain_loader_reads_the_worlds_share(tmp_path, monkeypatch, world, parallel, want):
    monkeypatch.setenv("RANK", "7")  # what the environment says must not matter
    monkeypatch.setenv("WORLD_SIZE", "8")
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1, 400, dtype=np.int64) % VOCAB)
    cfg = _cfg(ids, **parallel)
    seen = []
    parts = RECIPES["pretrain"].build(cfg, seen.append, world)
    assert len(seen) == 1 and seen[0] is parts.model
    assert (parts.data.rank, parts.data.world_size) == want
