"""PyTorch `.bin` checkpoints (pytorch_model.bin, or shards and their index, as transformers wrote them before
safetensors) read shard by shard like safetensors (kiln.parallel.sharded_load): each rank's tensors equal a whole
load then the same plans, and each rank reads only its share of the bytes, no tensor data through torch.load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kiln.errors import WeightsError
from kiln.hub.weights import load_weights, tensor_spans, weight_files
from kiln.models.auto import load_whole
from kiln.models.loading.stage import HostStage
from kiln.parallel.sharded_load import empty_pretrained, lean_pretrained, read_shards
from tests.parallel import sharded_load_workers as sw
from tests.parallel.test_sharded_load import bad_inputs_are_named
from tests.spawn import spawn


@pytest.fixture(scope="module")
def bin_dirs(tiny_factory, tmp_path_factory):
    src = tiny_factory("qwen3", "causal-lm", intermediate_size=48)  # a tiny Qwen3 built by transformers
    root = tmp_path_factory.mktemp("sharded_bin")
    return {"bin": sw.bin_release(src, root / "bin"), "bin-sharded": sw.bin_release(src, root / "bin-sharded", 8_000)}


@pytest.mark.parametrize("name", ["bin", "bin-sharded"])
def test_one_process_read_of_a_bin_checkpoint_equals_a_whole_load(bin_dirs, name):
    """Straight into place, and through the host stage a GPU target takes (chunks of 100 bytes)."""
    whole = load_whole(bin_dirs[name], task="causal-lm")
    for stage in (None, HostStage(limit=100)):
        lean = lean_pretrained(bin_dirs[name], "causal-lm", None)
        assert lean is not None  # read shard by shard, not loaded whole
        read_shards(lean, bin_dirs[name], stage=stage)
        a, b = whole.state_dict(), lean.state_dict()
        assert a.keys() == b.keys() and lean.load_report == whole.load_report
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert stage.peak == 100


def test_each_bin_file_offers_only_its_own_tensors(bin_dirs):
    """The reader a sharded read opens on a .bin shard (kiln.hub.index.CheckpointIndex.readers) lists (`keys`) the
    tensors of that file alone, as safe_open lists a safetensors file's."""
    from kiln.hub.index import CheckpointIndex

    by_file = {f: tensor_spans(f) for f in weight_files(bin_dirs["bin-sharded"])}
    where = {k: f for f, spans in by_file.items() for k in spans}
    assert len(by_file) > 1
    with CheckpointIndex(bin_dirs["bin-sharded"]).readers(list(where)) as handles:
        for k, h in handles.items():
            assert set(h.keys()) == set(by_file[where[k]]), k


def test_a_bin_s_disagreeing_shape_and_missing_shard_are_named(bin_dirs, tmp_path):
    bad_inputs_are_named(bin_dirs["bin-sharded"], tmp_path, "pytorch_model-00002")


def test_a_bin_not_stored_in_place_loads_whole(bin_dirs, tmp_path):
    """A pre-1.6 PyTorch file (no zip records to read slices from): the sharded read declines it, naming why, and
    `kiln train` loads it whole (lean_pretrained: None)."""
    old = tmp_path / "old"
    shutil.copytree(bin_dirs["bin"], old)
    torch.save(load_weights(bin_dirs["bin"]), old / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert lean_pretrained(old, "causal-lm", None) is None
    with pytest.raises(WeightsError, match=r"pytorch_model\.bin: not a zip-format PyTorch file .*loads whole"):
        empty_pretrained(old, task="causal-lm")
    a = load_whole(old, task="causal-lm").state_dict()
    b = load_whole(bin_dirs["bin"], task="causal-lm").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


CASES = [("fsdp", "bin"), ("fsdp", "bin-sharded"), ("tp", "bin-sharded"), ("fsdp-lora", "bin-sharded"), ("pp", "bin")]


@pytest.fixture(scope="module")
def bin_ranks(bin_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_bin_ranks")
    spawn(sw.compare_many, 2, ([(str(bin_dirs[name]), mode, f"{mode}-{name}") for mode, name in CASES], str(out)))
    return out


def _overlap(reads: list, f: str, offset: int, nbytes: int) -> int:
    return sum(max(0, min(o + n, offset + nbytes) - max(o, offset)) for g, o, n in reads if g == f)


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", CASES)
def test_each_rank_reads_its_share_of_a_bin_checkpoint(bin_dirs, bin_ranks, mode, name):
    """Under FSDP2 (also with LoRA), TP and PP on 2 gloo ranks: each rank holds exactly the tensors of a whole load
    then the same plans, took no tensor data through torch.load (its pickle read onto meta only), read no tensor
    whole, and read from the files only its rows of each (FSDP2: at most half the rows, rounded up), its columns
    (TP), or its stage's layers (PP)."""
    spans = {(str(f), k): s for f in weight_files(bin_dirs[name]) for k, s in tensor_spans(f).items()}
    total = sum(s.nbytes for s in spans.values())
    for rank in range(2):
        r = json.loads((bin_ranks / f"{mode}-{name}-rank{rank}.json").read_text())
        assert r["problems"] == [], (rank, r["problems"][:5])
        assert set(r["torch_loads"]) == {"meta"} and r["read_whole"] == [], r
        read = {key: _overlap(r["reads"], f, s.offset, s.nbytes) for (f, key), s in spans.items()}
        if mode == "fsdp":
            for (_f, key), s in spans.items():  # FSDP2's dim-0 chunks: ceil(rows / 2) on rank 0
                rows = s.shape[0] if s.shape else 1
                assert 0 < read[key] <= -(-rows // 2) * (s.nbytes // rows), (rank, key, read[key], s.nbytes)
        elif mode == "tp":  # each q/k/v/gate/up its rows, each o/down its columns; the rest (norms, embedding) whole
            split = [key for (_, key), s in spans.items() if key.endswith("_proj.weight")]
            assert split and all(read[k] * 2 == s.nbytes for (_, k), s in spans.items() if k in split), read
        elif mode == "pp":  # stage r reads layer r's tensors (and the embedding or the head), none of the other's
            assert {k for k, n in read.items() if n and ".layers." in k} == {k for k in read if f".layers.{rank}." in k}
        assert sum(r[2] for r in r["reads"]) < total, (sum(r[2] for r in r["reads"]), total)
