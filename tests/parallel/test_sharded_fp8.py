"""Kept FP8 (`fp8 = "keep"`), an FP8 weight no FP8 module holds (DeepSeek-V4's grouped `wo_a`) is read shard by
shard, dequantized as a whole load dequantizes it (kiln.parallel.sharded_fp8); the 2-rank FSDP2 case is in
test_sharded_load's spawn."""

from __future__ import annotations

import pytest
import torch

from kiln.models.auto import load_pretrained
from kiln.parallel.sharded_load import lean_pretrained, load_to_device, read_shards
from tests.models.v4_release import fp8_release_without_mtp
from tests.parallel.sharded_load_workers import _bits


@pytest.fixture(scope="module")
def v4fp8_dir(tiny_factory, tmp_path_factory):
    return fp8_release_without_mtp(tiny_factory, tmp_path_factory.mktemp("v4fp8"))


def test_an_fp8_weight_no_fp8_module_holds_is_read_dequantized_and_one_process_loads_it_whole(v4fp8_dir):
    """Kept FP8 (`fp8 = "keep"`), DeepSeek-V4's `wo_a` is dequantized as a whole load dequantizes it, its piece
    read with its scale blocks (sharded_fp8): the same tensors, bit for bit (2 ranks: test_sharded_load's spawn).
    One process (`load_to_device`) loads such a release whole: its export writes `wo_a` back from the pair a whole
    load keeps."""
    whole = load_pretrained(v4fp8_dir, task="causal-lm", fp8="keep")
    lean = lean_pretrained(v4fp8_dir, "causal-lm", None, fp8="keep")
    read_shards(lean, v4fp8_dir)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and lean.load_report == whole.load_report
    assert sorted(lean.unheld_fp8) == [f"layers.{i}.attn.wo_a.weight" for i in range(3)] == \
        sorted(k.removeprefix("model.") for k in whole.fp8_state.originals)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k
    assert load_to_device(v4fp8_dir, "cpu", task="causal-lm", fp8="keep") is None
