"""The loader: seeded order, rank shards that tile the global batch, exact state round trip, padding."""

from __future__ import annotations

import itertools

import pytest
import torch

from kiln.data.loader import Loader, batch_tokens, pad_collate
from kiln.errors import KilnError


def _data(n: int) -> list[dict]:
    return [{"input_ids": torch.arange(1, 2 + i % 5), "labels": torch.tensor(i)} for i in range(n)]


def _ids(batch) -> list[int]:
    return batch["labels"].tolist()


def test_rank_shards_tile_the_single_process_batches():
    data = _data(20)
    one = Loader(data, 4, seed=7)
    r0, r1 = Loader(data, 2, seed=7, rank=0, world_size=2), Loader(data, 2, seed=7, rank=1, world_size=2)
    for _ in range(12):  # crosses epochs (5 batches per epoch)
        assert _ids(one.next_batch()) == _ids(r0.next_batch()) + _ids(r1.next_batch())
    assert one.epoch == 2


def test_epochs_are_permutations_and_differ():
    data = _data(12)
    loader = Loader(data, 4, seed=1)
    e0 = list(itertools.chain.from_iterable(_ids(loader.next_batch()) for _ in range(3)))
    e1 = list(itertools.chain.from_iterable(_ids(loader.next_batch()) for _ in range(3)))
    assert sorted(e0) == sorted(e1) == list(range(12)) and e0 != e1


def test_state_round_trip_resumes_the_same_batches():
    data = _data(10)
    a = Loader(data, 3, seed=4)
    for _ in range(5):
        a.next_batch()
    b = Loader(data, 3, seed=4)
    b.load_state_dict(a.state_dict())
    assert [_ids(a.next_batch()) for _ in range(6)] == [_ids(b.next_batch()) for _ in range(6)]
    with pytest.raises(KilnError, match="state is for 10 examples with seed 4; this data has 9 examples"):
        Loader(data[:9], 3, seed=4).load_state_dict(a.state_dict())


def test_too_little_data_for_one_global_batch():
    with pytest.raises(KilnError, match=r"3 examples, fewer than one global batch \(2 per process x 2 processes\)"):
        Loader(_data(3), 2, world_size=2).check_size()


def test_pad_collate_pads_ids_labels_and_builds_the_mask():
    batch = pad_collate([{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1, 2, 3])},
                         {"input_ids": torch.tensor([8]), "labels": torch.tensor([4])}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_batch_tokens_leave_a_packed_row_padding_tail_out():
    # packed rows carry position_ids and no attention_mask: the collated tail looks like one more sample
    rows = [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1),
             "position_ids": torch.arange(n)} for n in (7, 3, 5, 2)]
    loader = Loader(rows, batch_size=2, seed=0)
    batch = loader.next_batch()
    real = int((batch["input_ids"] != 0).sum())  # ids count from 1: the tail is the pad id 0
    assert "attention_mask" not in batch and batch["input_ids"].numel() > real
    assert batch_tokens(batch, loader) == real
    # without a loader's count: the mask, else every id
    assert batch_tokens({"input_ids": torch.ones(2, 4), "attention_mask": torch.tensor([[1, 1, 0, 0]] * 2)}, None) == 4
    assert batch_tokens({"input_ids": torch.ones(2, 4)}, None) == 8


def test_batch_tokens_counts_every_side_of_a_paired_batch():
    from kiln.data.loader import batch_tokens

    pairs = {"anchor_input_ids": torch.ones(2, 4, dtype=torch.long),
             "anchor_attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "positive_input_ids": torch.ones(2, 3, dtype=torch.long),
             "positive_attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    assert batch_tokens(pairs, object()) == 5 + 4
    assert batch_tokens({"input_ids": torch.ones(2, 3, dtype=torch.long)}, object()) == 6
