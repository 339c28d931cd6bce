"""Weights on disk: native dtypes kept byte for byte, shards, the .bin fallback, and bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.errors import WeightsError
from kiln.hub import load_weights, save_weights
from kiln.interop.verify import compare_weights
from kiln.models import load_pretrained


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_checkpoints_round_trip_byte_identical(dtype, tiny_factory, tmp_path):
    import transformers

    src32 = tiny_factory("bert", "masked-lm")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(src32).to(dtype)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    model = load_pretrained(src)
    assert {p.dtype for p in model.parameters()} == {dtype}  # never passed through f32
    out = tmp_path / "out"
    model.save_pretrained(out)
    check = compare_weights(out, src)
    assert check.ok, check.detail
    a, b = load_weights(out), load_weights(src)
    for k in a:
        assert a[k].dtype == dtype
        assert a[k].view(torch.uint8).numpy().tobytes() == b[k].view(torch.uint8).numpy().tobytes(), k


def test_sharded_save_and_load(tiny_factory, tmp_path):
    model = load_pretrained(tiny_factory("bert", "base"))
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    again = load_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_pytorch_model_bin_fallback(tiny_factory, tmp_path):
    src = tiny_factory("roberta", "base")
    state = load_weights(src)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = load_pretrained(tmp_path)
    ref = load_pretrained(src)
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_truncated_safetensors_is_named(tiny_factory, tmp_path):
    src = tiny_factory("bert", "base")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors: not a readable safetensors file"):
        load_pretrained(tmp_path)


def test_non_safetensors_file_is_named(tiny_factory, tmp_path):
    src = tiny_factory("bert", "base")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_text("this is not a weights file\n")
    with pytest.raises(WeightsError, match=r"model\.safetensors: not a readable safetensors file"):
        load_pretrained(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(WeightsError, match="model-1.safetensors"):
        load_weights(tmp_path)


def test_save_writes_atomically_and_leaves_no_temp_files(tmp_path):
    save_weights(tmp_path, {"w": torch.arange(6.0).view(2, 3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    assert torch.equal(load_weights(tmp_path)["w"], torch.arange(6.0).view(2, 3))


def test_bin_spans_locate_each_tensor_without_reading_it(tmp_path):
    """torch.save's zip format: each tensor's bytes (views into a shared storage at an offset, a tied pair) found
    from the pickle read onto meta, read back through SpanReader whole and as row and column runs; a strided
    tensor is refused by name (it loads whole)."""
    from kiln.hub.pickled import NotInPlace
    from kiln.hub.weights import SpanReader, tensor_spans

    g = torch.Generator().manual_seed(0)
    big = torch.randn(60, generator=g)
    state = {"a": torch.randn(7, 5, 3, generator=g), "b": torch.randn(6, 9, generator=g).to(torch.bfloat16),
             "view": big[4:40].view(6, 6), "scalar": torch.tensor(3.0), "empty": torch.empty(0, 4)}
    state["tied"] = state["b"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    spans = tensor_spans(tmp_path / "pytorch_model.bin")
    assert spans["tied"] == spans["b"] and spans["view"].nbytes == 36 * 4 and spans["scalar"].shape == ()
    with open(tmp_path / "pytorch_model.bin", "rb", buffering=0) as f:
        reader = SpanReader(f, spans)
        for k, t in state.items():
            assert torch.equal(reader.get_tensor(k), t), k
            for box in [(slice(1, 3),), (slice(0, 4), slice(1, 2)), (slice(1, 2), slice(0, 3), slice(1, 3))]:
                if t.dim() >= len(box):
                    assert torch.equal(reader.get_slice(k)[box], t[box]), (k, box)
    torch.save({"w": torch.randn(4, 6).t()}, tmp_path / "strided.bin")
    with pytest.raises(NotInPlace, match=r"strided\.bin: tensor 'w' is not stored as one run of bytes"):
        tensor_spans(tmp_path / "strided.bin")


def test_span_slices_read_a_run_of_whole_rows_at_once_and_give_safetensors_dtypes(tmp_path, monkeypatch):
    """A .bin tensor's full-width rows (FSDP2's piece: the box names every column) are one read, a 2-D as a 3-D
    tensor's; its slice names its dtype as safe_open's does (`get_dtype`)."""
    from kiln.hub import index as weights  # where the reading lives
    from kiln.hub.weights import SpanReader, tensor_spans

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(6, 9, generator=g).to(torch.bfloat16), "x": torch.randn(5, 4, 3, generator=g),
             "i": torch.arange(8, dtype=torch.int8).view(2, 4), "e": torch.zeros(3, 2).to(torch.float8_e4m3fn)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    save_file(state, str(tmp_path / "model.safetensors"))
    reads = []
    read_into = weights.read_into
    monkeypatch.setattr(weights, "read_into", lambda f, offset, t: (reads.append(t.nbytes), read_into(f, offset, t))[1])
    with open(tmp_path / "pytorch_model.bin", "rb", buffering=0) as f, \
            safe_open(str(tmp_path / "model.safetensors"), framework="pt") as h:
        reader = SpanReader(f, tensor_spans(tmp_path / "pytorch_model.bin"))
        for k in state:
            assert reader.get_slice(k).get_dtype() == h.get_slice(k).get_dtype(), k
        for k, box in [("w", (slice(1, 4), slice(0, 9))), ("x", (slice(2, 5), slice(0, 4))), ("x", (slice(0, 2),))]:
            reads.clear()
            assert torch.equal(reader.get_slice(k)[box], state[k][box]) and reads == [state[k][box].nbytes], (k, box)


def test_a_bin_that_cannot_be_read_in_place_says_why(tmp_path, monkeypatch):
    """Each reason a .bin loads whole is named apart: big-endian bytes, the compressed record, no file offset."""
    import zipfile

    from kiln.hub import pickled
    from kiln.hub.pickled import NotInPlace, bin_layout

    torch.save({"w": torch.randn(4, 6)}, tmp_path / "plain.bin")
    with zipfile.ZipFile(tmp_path / "plain.bin") as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    for name, order, method in [("big.bin", b"big", zipfile.ZIP_STORED),
                                ("packed.bin", b"little", zipfile.ZIP_DEFLATED)]:
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            for filename, data in records:
                data = order if filename.endswith("/byteorder") else data
                z.writestr(filename, data, method if "/data/" in filename else zipfile.ZIP_STORED)
    with pytest.raises(NotInPlace, match=r"big\.bin: its tensors are stored big-endian"):
        bin_layout(tmp_path / "big.bin")
    with pytest.raises(NotInPlace, match=r"packed\.bin: its tensor record '[^']*/data/0' is compressed"):
        bin_layout(tmp_path / "packed.bin")
    monkeypatch.setattr(pickled, "load_bin", lambda path, where: {"w": torch.empty(4, 6, device="meta")})
    with pytest.raises(NotInPlace, match=r"plain\.bin: torch gave no file offset for tensor 'w'"):
        bin_layout(tmp_path / "plain.bin")
