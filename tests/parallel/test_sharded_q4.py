"""4-bit bases read shard by shard (kiln.parallel.sharded_q4): a bitsandbytes-4bit directory, and a bf16 checkpoint
quantized at load, give each rank the packed bytes and quant state of a whole load then the same plans, byte for
byte, while no rank reads a whole packed (or bf16) weight.

The shapes are chosen so the ranks' bytes start and end inside blocks of 64 values (one rank's first block is
quantized by both), a weight has an odd number of values (a half-filled last byte) and a partial last block, and
the MLP weights have 257 blocks (two nested absmax groups: the double quantization runs over the whole vector)."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.hub.weights import tensor_spans, weight_files
from kiln.models.auto import AutoConfig, from_config, load_pretrained
from kiln.models.common.quant4 import quantize_model
from kiln.parallel.sharded_load import lean_pretrained, load_to_device, read_shards
from tests.parallel import sharded_load_workers as sw
from tests.spawn import spawn

# q_proj 24 x 41 (984 values: 15.4 blocks), gate/up 401 x 41 (16,441 values, odd: 257 blocks, the last of 57)
ODD = dict(vocab_size=99, hidden_size=41, intermediate_size=401, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=6, max_position_embeddings=64)


@pytest.fixture(scope="module")
def q4_dirs(tmp_path_factory):
    """The bf16 checkpoint (several files), and bitsandbytes-4bit directories written from it: NF4 with double
    quantization, FP4 without."""
    root = tmp_path_factory.mktemp("sharded_q4")
    model = from_config(AutoConfig.for_model("qwen3", **ODD), task="causal-lm", seed=0).to(torch.bfloat16)
    model.save_pretrained(root / "bf16", max_shard_bytes=40_000)
    out = {"bf16": root / "bf16"}
    for quant, double in (("nf4", True), ("fp4", False)):
        q = load_pretrained(root / "bf16", task="causal-lm")
        quantize_model(q, quant, double_quant=double)
        q.save_pretrained(root / f"bnb-{quant}", max_shard_bytes=40_000)
        out[f"bnb-{quant}"] = root / f"bnb-{quant}"
    return out


CASES = [("bf16", "nf4"), ("bf16", "fp4"), ("bnb-nf4", None), ("bnb-fp4", None)]


@pytest.mark.parametrize("name,quantize", CASES)
def test_one_process_read_equals_a_whole_load(q4_dirs, name, quantize):
    """One process (or DDP): built 4-bit on meta, each weight read (and quantized) in turn."""
    from kiln.train.resume import _shape_changes, model_fingerprint

    whole = load_pretrained(q4_dirs[name], task="causal-lm", quantize=quantize, seed=1)
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
        load_pretrained(q4_dirs["bnb-nf4"], quantize="nf4")


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


# (checkpoint, mode, quantize) on 2 ranks, all in one spawn
RANK_CASES = [("bf16", "fsdp", "nf4"), ("bf16", "fsdp", "fp4"), ("bf16", "fsdp-lora", "nf4"), ("bnb-nf4", "fsdp", None),
              ("bnb-fp4", "fsdp-lora", None), ("bf16", "pp", "nf4")]


@pytest.fixture(scope="module")
def q4_ranks(q4_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_q4_ranks")
    spawn(sw.compare_many, 2, ([(str(q4_dirs[name]), mode, f"{name}-{mode}-{quant}", quant)
                                for name, mode, quant in RANK_CASES], str(out)))
    return out


def _read(r: dict, f: str, s) -> int:
    """Bytes of tensor `s` (in file `f`) that a rank's 4-bit reads took."""
    return sum(max(0, min(o + n, s.offset + s.nbytes) - max(o, s.offset)) for g, o, n in r["q4_reads"] if g == f)


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,quantize", RANK_CASES)
def test_each_rank_reads_its_4bit_rows_as_a_whole_load_then_shard_gives(q4_dirs, q4_ranks, name, mode, quantize):
    # every 4-bit weight of the checkpoint: (file, where its bytes lie)
    spans = {(str(f), k): s for f in weight_files(q4_dirs[name]) for k, s in tensor_spans(f).items()
             if k.endswith("_proj.weight")}
    assert len(spans) == 14
    for rank in range(2):
        r = json.loads((q4_ranks / f"{name}-{mode}-{quantize}-rank{rank}.json").read_text())
        assert r["problems"] == [], (rank, r["problems"][:5])
        assert not [n for n in r["read_whole"] if n.endswith("_proj.weight")], r["read_whole"]
        if mode == "pp":  # each stage reads (and quantizes) its own layers' weights only
            layer = f"layers.{rank}."
            assert {k for (f, k), s in spans.items() if _read(r, f, s)} == {k for _, k in spans if layer in k}
            continue
        for (f, key), s in spans.items():
            read = _read(r, f, s)
            # its half of the bytes, and (quantized at load) at most one block more at each end of its run
            extra = 2 * 64 * s.dtype.itemsize if quantize else 1
            assert 0 < read <= s.nbytes / 2 + extra, (rank, key, read, s.nbytes)
        if mode == "fsdp":  # about half the model each (LoRA's frozen embedding and head stay whole on every rank)
            assert r["bytes"] <= 0.7 * r["whole_bytes"], r
