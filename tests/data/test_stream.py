"""The token stream: every token once per epoch under any rank x worker split, seeded shard order,
document positions, and an exact resume from a saved cursor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from kiln.data.shards import ShardSet
from kiln.data.stream import EpochStream, StreamLoader, Windows, data_loader
from kiln.errors import KilnError
from tests.data.tokdata import write_synthetic_shards

LENGTHS = [50, 37, 64, 11, 90, 23]   # 275 tokens, shards of uneven size
T, B = 16, 3


@pytest.fixture()
def shards(tmp_path) -> ShardSet:
    return ShardSet(write_synthetic_shards(tmp_path / "s", LENGTHS), "train")


def _rows(batch: dict) -> list[tuple[int, ...]]:
    """Each row back as its window: the first input token, then every real target (filler rows, which
    have no targets, are left out)."""
    out = []
    for x, y in zip(batch["input_ids"].tolist(), batch["targets"].tolist()):
        if any(t != -100 for t in y):
            out.append(tuple([x[0]] + [t for t in y if t != -100]))
    return out


def _epoch_windows(shards: ShardSet, ranks: int, workers: int, epoch: int = 0) -> list[tuple[int, ...]]:
    windows = Windows(shards, T, seed=7)
    got = []
    for rank in range(ranks):
        for batch in data_loader(EpochStream(windows, B, rank, ranks, epoch), num_workers=workers):
            got += _rows(batch)
    return got


def test_one_epoch_same_windows_for_any_split_and_every_token_once(shards):
    reads = {(r, w): _epoch_windows(shards, r, w) for r, w in [(1, 0), (1, 2), (2, 2)]}
    ref = Counter(reads[(1, 0)])
    for key, windows in reads.items():
        assert Counter(windows) == ref, f"{key[0]} rank(s) x {key[1]} worker(s) read other windows"
    windows = list(ref.elements())
    assert len(windows) == Windows(shards, T).per_epoch == 18          # ceil(274 / 16)
    # window = T+1 tokens overlapping by one: inputs cover all but the epoch's last token, targets all
    # but its first, each exactly once (tokens are unique except EOS = 0)
    every = Counter(np.concatenate([shards.tokens(i) for i in range(len(LENGTHS))]).tolist())
    stream = np.concatenate([shards.tokens(i) for i in Windows(shards, T, seed=7).order(0)])
    inputs = Counter(t for w in windows for t in w[:-1])
    targets = Counter(t for w in windows for t in w[1:])
    assert inputs + Counter([int(stream[-1])]) == every
    assert targets + Counter([int(stream[0])]) == every
    assert max(c for t, c in every.items() if t != 0) == 1        # so each non-EOS token was read once

def test_every_rank_gets_the_same_number_of_eval_batches(shards):
    windows = Windows(shards, T)                        # 18 windows over 4 ranks: 5, 5, 4, 4
    counts = [[len(b["input_ids"]) for b in data_loader(EpochStream(windows, B, r, 4))] for r in range(4)]
    assert counts == [[3, 2]] * 4                       # filler rows keep collective forwards in step
    assert Counter(_epoch_windows(shards, 4, 0)) == Counter(_epoch_windows(shards, 1, 0))


def test_shard_order_is_seeded_per_epoch(shards):
    w, same = Windows(shards, T, seed=7), Windows(shards, T, seed=7)
    orders = [w.order(e).tolist() for e in range(4)]
    assert orders == [same.order(e).tolist() for e in range(4)]
    assert len({tuple(o) for o in orders}) > 1
    assert sorted(orders[0]) == list(range(len(LENGTHS)))
    # the epoch's stream is the shards concatenated in that order
    stream = np.concatenate([shards.tokens(i) for i in orders[1]])
    assert (w.span(1, 0, len(stream)) == stream).all()
    assert Counter(_epoch_windows(shards, 1, 0, epoch=1)) != Counter(_epoch_windows(shards, 1, 0, epoch=0))


def _train_rows(shards, ranks: int, workers: int, steps: int) -> list[tuple[int, ...]]:
    """The windows of the first `steps` global batches, rank 0's rows then rank 1's, step by step."""
    loaders = [StreamLoader(Windows(shards, T, seed=7), B, rank=r, world_size=ranks, num_workers=workers)
               for r in range(ranks)]
    rows = []
    for _ in range(steps):
        for loader in loaders:
            rows += _rows(loader.next_batch())
    return rows


def test_training_order_does_not_depend_on_workers_or_ranks(shards):
    one = _train_rows(shards, 1, 0, 12)          # 12 batches of 3 = 36 windows: two epochs
    assert _train_rows(shards, 1, 2, 12) == one
    assert _train_rows(shards, 2, 2, 6) == one   # 2 ranks x 3 rows = the same global batches
    assert Counter(one[:18]) == Counter(_epoch_windows(shards, 1, 0, 0))
    assert Counter(one[18:]) == Counter(_epoch_windows(shards, 1, 0, 1))


def test_positions_restart_after_each_document(shards):
    w = Windows(shards, T, within_doc=True)
    batch = w.batch(range(4))
    x, pos = batch["input_ids"], batch["position_ids"]
    for row in range(4):
        expect, p = [], 0
        for i in range(T):
            expect.append(p)
            p = 0 if x[row, i] == 0 else p + 1
        assert pos[row].tolist() == expect
    assert "position_ids" not in Windows(shards, T).batch(range(2))


def test_stopped_and_resumed_stream_reads_the_same_windows(shards):
    def loader():
        return StreamLoader(Windows(shards, T, seed=3), B, num_workers=2, prefetch=2)

    ref = loader()
    expected = [ref.next_batch()["input_ids"] for _ in range(16)]     # crosses two epoch boundaries
    first = loader()
    got = [first.next_batch()["input_ids"] for _ in range(7)]         # workers have prefetched beyond 7
    state = json.loads(json.dumps(first.state_dict()))                 # as a checkpoint stores it
    assert state["next_window"] == 21 and state["epoch"] == 1 and state["window_in_epoch"] == 3
    assert state["token_offset"] == 48 and sorted(state["shard_order"]) == list(range(len(LENGTHS)))
    first.close()
    second = loader()
    second.load_state_dict(state)
    got += [second.next_batch()["input_ids"] for _ in range(9)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == 16


def test_resume_refuses_a_different_stream(shards):
    state = StreamLoader(Windows(shards, T, seed=3), B).state_dict()
    other = StreamLoader(Windows(shards, T + 1, seed=4), B * 2)
    with pytest.raises(KilnError, match=r"does not fit this stream: seed 3 -> 4; seq_len 16 -> 17; global batch 3 -> 6"):
        other.load_state_dict(state)


def test_split_smaller_than_a_global_batch(shards):
    loader = StreamLoader(Windows(shards, 100), batch_size=2, world_size=2, rank=0)
    with pytest.raises(KilnError, match=r"split 'train' has 275 tokens, 3 window\(s\) of 100\+1, fewer than one "
                                        r"global batch \(2 per process x 2 processes\)"):
        loader.check_size()
