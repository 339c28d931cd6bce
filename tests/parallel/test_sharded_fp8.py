"""Kept FP8 (`fp8 = "keep"`), an FP8 weight no FP8 module holds (DeepSeek-V4's grouped `wo_a`) is read shard by
shard, dequantized as a whole load dequantizes it (kiln.parallel.sharded_fp8); the 2-rank FSDP2 case is in
test_sharded_load's spawn."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.errors import KilnError
from kiln.models.auto import load_whole
from kiln.parallel.checkpoint import export_sharded, save_sharded
from kiln.parallel.sharded_load import lean_pretrained, load_to_device, read_shards
from tests.models.v4_release import fp8_release_without_mtp
from tests.parallel.sharded_load_workers import _bits


@pytest.fixture(scope="module")
def v4fp8_dir(tiny_factory, tmp_path_factory):
    return fp8_release_without_mtp(tiny_factory, tmp_path_factory.mktemp("v4fp8"))


def test_an_fp8_weight_no_fp8_module_holds_is_read_dequantized_and_one_process_holds_its_pair(v4fp8_dir):
    """Kept FP8 (`fp8 = "keep"`), DeepSeek-V4's `wo_a` is dequantized as a whole load dequantizes it, its piece
    read with its scale blocks (sharded_fp8): the same tensors, bit for bit (2 ranks: test_sharded_load's spawn).
    One process (`load_to_device`) reads the plan too and then the pairs a whole load keeps (its export writes `wo_a`
    back from them)."""
    whole = load_whole(v4fp8_dir, task="causal-lm", fp8="keep")
    lean = lean_pretrained(v4fp8_dir, "causal-lm", None, fp8="keep")
    unheld = sorted(lean.deferred_read.unheld_fp8)  # what the read dequantizes (declared data, gone once read)
    read_shards(lean, v4fp8_dir)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and lean.load_report == whole.load_report and lean.deferred_read is None
    assert unheld == [f"layers.{i}.attn.wo_a.weight" for i in range(3)] == \
        sorted(k.removeprefix("model.") for k in whole.fp8_state.originals)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k
    one = load_to_device(v4fp8_dir, "cpu", task="causal-lm", fp8="keep")  # one process: the pairs held, as whole
    c, d = one.fp8_state.originals, whole.fp8_state.originals
    assert list(c) == list(d) and all(torch.equal(_bits(x), _bits(y)) for n in c for x, y in zip(c[n], d[n]))


def test_a_sharded_checkpoint_reads_the_pairs_it_writes_back_from_the_source_and_names_one_gone(v4fp8_dir, tmp_path):
    """Read shard by shard, `wo_a`'s FP8 pairs stay in the release's file: the sharded checkpoint notes where
    (model/load.json), its export writes them back byte for byte under the release's names, and one whose source
    changed since is refused by the tensor's and the file's names, nothing written (sharded_fp8_export)."""
    release = Path(shutil.copytree(v4fp8_dir, tmp_path / "release"))
    lean = lean_pretrained(release, "causal-lm", None, fp8="keep")
    read_shards(lean, release)
    save_sharded(tmp_path / "ckpt", lean)  # one process: the layout a 2-rank run's checkpoint reads back into
    got = load_file(str(export_sharded(tmp_path / "ckpt", tmp_path / "out") / "model.safetensors"))
    stored = load_file(str(release / "model.safetensors"))
    assert list(got) == list(stored) and all(got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v))
                                             for k, v in stored.items())
    os.utime(release / "model.safetensors", ns=(0, 0))
    with pytest.raises(KilnError, match=r"'model.layers.0.attn.wo_a.weight' \(fp8 pair\).*'layers.0.attn.wo_a.weight'"
                                        r" of .*release/model.safetensors, which changed since the run read it"):
        export_sharded(tmp_path / "ckpt", tmp_path / "changed")
    assert not (tmp_path / "changed").exists()
