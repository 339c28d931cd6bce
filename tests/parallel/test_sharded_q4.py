"""4-bit bases read without a whole load (kiln.models.loading.q4), in one process (or DDP): a bitsandbytes-4bit
directory, and a bf16 checkpoint quantized at load weight by weight, equal a whole load byte for byte. On 2 ranks
(each its rows): tests/parallel/test_sharded_load.py, in the same spawn as the other modes.

The shapes (sharded_load_workers.ODD_Q4) give a weight an odd number of values (a half-filled last byte) and a
partial last block, and the MLP weights 257 blocks (two nested absmax groups: the double quantization runs over
the whole vector)."""

from __future__ import annotations

import pytest
import torch

from kiln.hub.weights import tensor_spans, weight_files
from kiln.models.auto import load_whole
from kiln.parallel.sharded_load import lean_pretrained, load_to_device, read_shards
from tests.parallel import sharded_load_workers as sw


@pytest.fixture(scope="module")
def q4_dirs(tmp_path_factory):
    return sw.q4_checkpoints(tmp_path_factory.mktemp("sharded_q4"))


CASES = [("bf16", "nf4"), ("bnb-fp4", None)]  # (FP4 quantized at load, NF4 directories: on 2 ranks)


@pytest.mark.parametrize("name,quantize", CASES)
def test_one_process_read_equals_a_whole_load(q4_dirs, name, quantize, monkeypatch):
    """One process (or DDP): built 4-bit on meta, each weight read (and quantized, in chunks of 101 blocks) in turn."""
    from kiln.models.loading import q4 as sharded_q4
    from kiln.train.resume import _shape_changes, model_fingerprint

    monkeypatch.setattr(sharded_q4, "CHUNK_VALUES", 101 * 64)

    whole = load_whole(q4_dirs[name], task="causal-lm", quantize=quantize, seed=1)
    # a run built on meta takes its fingerprint before the read (the quant-state JSON's length is not known yet)
    unread = lean_pretrained(q4_dirs[name], "causal-lm", None, quantize=quantize)
    assert _shape_changes(model_fingerprint(unread)["shapes"], model_fingerprint(whole)["shapes"]) == []
    lean = load_to_device(q4_dirs[name], "cpu", task="causal-lm", quantize=quantize, seed=1)
    assert lean is not None
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and sum(k.endswith("weight_absmax") for k in b) == 14
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert lean.load_report == whole.load_report and lean.config.extra == whole.config.extra
    assert [m.q4 for m in lean.modules() if hasattr(m, "q4")] == [m.q4 for m in whole.modules() if hasattr(m, "q4")]
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(ids).logits, lean(ids).logits)


def test_quantizing_a_4bit_directory_still_refuses_by_message(q4_dirs):
    from kiln.errors import ConfigError

    assert lean_pretrained(q4_dirs["bnb-nf4"], "causal-lm", None, quantize="nf4") is None  # the whole load says why
    with pytest.raises(ConfigError, match="already 4-bit quantized"):
        load_whole(q4_dirs["bnb-nf4"], quantize="nf4")


def test_a_4bit_tensor_whose_shape_disagrees_is_named(q4_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from kiln.errors import WeightsError

    broken = tmp_path / "broken"
    shutil.copytree(q4_dirs["bf16"], broken)
    lean = lean_pretrained(broken, "causal-lm", None, quantize="nf4")
    f = next(f for f in weight_files(broken) if any("q_proj.weight" in k for k in tensor_spans(f)))
    state = load_file(str(f))
    key = next(k for k in state if k.endswith("q_proj.weight"))
    save_file({**state, key: state[key][:-1]}, str(f), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=rf"{key}.*shape \(23, 41\).*expects \(24, 41\)"):
        read_shards(lean, broken)


def test_a_qlora_run_of_one_process_never_loads_the_bf16_model_whole(q4_dirs, monkeypatch):
    """`kiln train` with `[model] quantize` and no sharding (one process, or DDP): built 4-bit on meta and read
    weight by weight (load_to_device), never `load_pretrained`'s whole bf16 model."""
    from kiln.train.config import parse_run_config
    from kiln.train.recipes import base

    cfg = parse_run_config({"model": {"path": str(q4_dirs["bf16"]), "task": "causal-lm", "quantize": "nf4"},
                            "data": {"train": "unused.jsonl"}, "train": {"out_dir": "unused", "steps": 1, "device": "cpu"}})
    monkeypatch.setattr(base, "load_pretrained", lambda *a, **k: pytest.fail("loaded whole"))
    model = base.build_model(cfg, None, need_tokenizer=False)
    assert model.deferred_read is None and model.bnb4_state.scheme.quant_type == "nf4"
    assert model.get_submodule("model.layers.0.mlp.up_proj").q4.offset != 0.0  # the read's double quant

