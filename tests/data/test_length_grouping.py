"""Length-grouped batching: the same examples per epoch as the plain order, batches of similar lengths
(less padding), step-sized groups (so grad_accum k x b sees the batches of one k*b batch), exact resume."""

from __future__ import annotations

import itertools

import torch

from kiln.data.loader import Loader


def _data(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 200, (n,), generator=g).tolist()
    return [{"input_ids": torch.ones(k, dtype=torch.long), "labels": torch.tensor(i)} for i, k in enumerate(lengths)]


def _epoch(loader: Loader, batches: int) -> list[list[int]]:
    return [loader.next_batch()["labels"].tolist() for _ in range(batches)]


def _pad_share(loader: Loader, batches: int) -> float:
    _epoch(loader, batches)
    return loader.take_pad_fraction()


def test_grouped_epoch_covers_what_the_plain_epoch_covers_and_pads_less():
    data = _data(403)
    plain, grouped = Loader(data, 8, seed=3), Loader(data, 8, seed=3, group_by_length=True)
    n = plain.batches_per_epoch
    a, b = _epoch(plain, n), _epoch(grouped, n)
    assert len(set(itertools.chain.from_iterable(a))) == len(set(itertools.chain.from_iterable(b))) == n * 8 == 400  # 400 distinct examples per epoch
    assert a != b
    plain, grouped = Loader(data, 8, seed=3), Loader(data, 8, seed=3, group_by_length=True)
    p, q = _pad_share(plain, n), _pad_share(grouped, n)
    assert q < 0.1 < 0.3 < p, (p, q)  # sorted within mega-batches of 50 steps: little padding left


def test_grouped_order_is_seeded_and_resumes_exactly_across_epochs():
    data = _data(90)
    a = Loader(data, 4, seed=9, group_by_length=True, window=2)
    for _ in range(30):  # past the first epoch (22 batches)
        a.next_batch()
    b = Loader(data, 4, seed=9, group_by_length=True, window=2)
    b.load_state_dict(a.state_dict())
    assert _epoch(a, 40) == _epoch(b, 40)
    c, d = Loader(data, 4, seed=9, group_by_length=True), Loader(data, 4, seed=10, group_by_length=True)
    assert _epoch(c, 5) != _epoch(d, 5)  # a control: the seed matters


def test_micro_batches_of_a_step_are_the_batch_of_that_step():
    data = _data(64, seed=1)
    big = Loader(data, 8, seed=5, group_by_length=True)
    small = Loader(data, 2, seed=5, group_by_length=True, window=4)
    for _ in range(10):
        assert sorted(big.next_batch()["labels"].tolist()) == sorted(itertools.chain.from_iterable(_epoch(small, 4)))


def test_ranks_tile_the_grouped_global_batch():
    data = _data(50, seed=2)
    one = Loader(data, 6, seed=1, group_by_length=True)
    r0 = Loader(data, 3, seed=1, rank=0, world_size=2, group_by_length=True)
    r1 = Loader(data, 3, seed=1, rank=1, world_size=2, group_by_length=True)
    for _ in range(12):
        assert _epoch(one, 1)[0] == _epoch(r0, 1)[0] + _epoch(r1, 1)[0]


def test_pad_fraction_counts_padded_slots_since_the_last_call():
    data = [{"input_ids": torch.ones(k, dtype=torch.long)} for k in (4, 2, 4, 4)]
    loader = Loader(data, 2, shuffle=False)
    assert loader.take_pad_fraction() is None
    loader.next_batch(), loader.next_batch()  # (4, 2): 2 of 8 padded; (4, 4): none
    assert loader.take_pad_fraction() == 2 / 16
    assert loader.take_pad_fraction() is None
