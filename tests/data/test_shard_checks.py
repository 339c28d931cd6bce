"""What token shards promise, checked: sha256 once per run (inline when small, on a thread when large)
and token ids inside the manifest's vocabulary, naming the shard that changed."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kiln.data.shards import ShardError, ShardSet
from kiln.data.stream import StreamLoader, Windows
from kiln.hub.files import file_sha256
from tests.data.tokdata import write_synthetic_shards


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_sha256_inline_and_in_the_background(tmp_path):
    root = write_synthetic_shards(tmp_path / "s", [50, 60])
    ShardSet(root, "train").start_verify()  # intact: nothing raised
    _flip_last_byte(root / "train-00001.npy")  # same size and header: only the checksum can tell
    shards = ShardSet(root, "train")
    with pytest.raises(ShardError, match=r"train-00001.npy: contents do not match the sha256"):
        shards.start_verify()
    shards = ShardSet(root, "train")
    shards.start_verify(inline_bytes=0)  # as for a large split: a thread, polled by the loop
    for _ in range(200):
        if shards._problem is not None:
            break
        time.sleep(0.01)
    with pytest.raises(ShardError, match=r"train-00001.npy: contents do not match"):
        shards.raise_if_corrupt()
    loader = StreamLoader(Windows(shards, 8), batch_size=2, rank=0, world_size=1)
    with pytest.raises(ShardError, match="contents do not match"):
        loader.next_batch()  # the loader polls it before handing out a batch


def test_an_id_past_the_vocabulary_stops_the_stream_with_a_message(tmp_path):
    root = write_synthetic_shards(tmp_path / "s", [40])
    path = root / "train-00000.npy"
    ids = np.load(path)
    ids[2] = 10_000  # past vocab_size (42); the manifest's checksum updated so only the range check sees it
    np.save(path, ids)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = file_sha256(path)
    (root / "manifest.json").write_text(json.dumps(manifest))
    loader = StreamLoader(Windows(ShardSet(root, "train"), 8, shuffle=False), batch_size=2, rank=0, world_size=1)
    with pytest.raises(ShardError, match=r"holds token id 10000, past the vocabulary of 42"):
        loader.next_batch()
    # control: the same shards without the bad id stream fine
    ids[2] = 3
    np.save(path, ids)
    manifest["splits"]["train"]["shards"][0]["sha256"] = file_sha256(path)
    (root / "manifest.json").write_text(json.dumps(manifest))
    loader = StreamLoader(Windows(ShardSet(root, "train"), 8, shuffle=False), batch_size=2, rank=0, world_size=1)
    assert loader.next_batch()["input_ids"].shape == (2, 8)
