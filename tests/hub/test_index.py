"""One checkpoint index per load (kiln.hub.index): the path resolved once, every weight file's header read once, by
the whole load, the sharded load (built on meta, then read) and `kiln plan` alike."""

from __future__ import annotations

import collections
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from kiln.errors import WeightsError
from kiln.hub.index import CheckpointIndex, tensor_spans

SIZE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@contextmanager
def counting():
    """(header reads per file name, path resolutions) while the block runs: every parse of a safetensors header
    (kiln's own, and any `safe_open`, which parses it too), every unpickling of a .bin file (onto meta or with its
    data), and every `resolve_model_dir`, wherever a kiln module holds those names."""
    import kiln.hub.headers as headers
    import kiln.hub.pickled as pickled
    import kiln.hub.resolve as resolve

    reads: collections.Counter[str] = collections.Counter()
    resolves = [0]

    def counted(fn, on_call):
        def wrapper(*a, **k):
            on_call(a)
            return fn(*a, **k)
        return wrapper

    wrap = {
        headers.parse_safetensors: lambda a: reads.update([Path(a[0]).name]),
        pickled.load_bin: lambda a: reads.update([Path(a[0]).name]),
        safetensors.safe_open: lambda a: reads.update([Path(a[0]).name]),
        resolve.resolve_model_dir: lambda a: resolves.__setitem__(0, resolves[0] + 1),
    }
    wrappers = {id(fn): counted(fn, on) for fn, on in wrap.items()}
    undo = []
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("kiln"):
            for attr, value in list(vars(mod).items()):
                if id(value) in wrappers:
                    undo.append((mod, attr, value))
                    setattr(mod, attr, wrappers[id(value)])
    try:
        yield reads, resolves
    finally:
        for mod, attr, value in undo:
            setattr(mod, attr, value)


@pytest.fixture(scope="module")
def dirs(tiny_factory, tmp_path_factory):
    from kiln.models.auto import AutoConfig, from_config
    from tests.models.fp8_cases import make_fp8
    from tests.parallel import sharded_load_workers as sw

    root = tmp_path_factory.mktemp("index")
    model = from_config(AutoConfig.for_model("qwen3", **SIZE), task="causal-lm", seed=0)
    tiny = tiny_factory("qwen3", "causal-lm", intermediate_size=48)
    return {"safetensors": model.to(torch.bfloat16).save_pretrained(root / "st", max_shard_bytes=8_000),
            "bin": sw.bin_release(tiny, root / "bin", 8_000),
            "fp8": make_fp8(tiny, root / "fp8", "Qwen3ForCausalLM")}


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))


@pytest.mark.parametrize("name,kw", [("safetensors", {}), ("bin", {}), ("fp8", {}), ("fp8", {"fp8": "keep"}),
                                     ("safetensors", {"quantize": "nf4"})])
def test_each_load_reads_each_header_once_and_resolves_the_path_once(dirs, name, kw):
    from kiln.models.auto import load_pretrained
    from kiln.parallel.sharded_load import lean_pretrained, read_plan, read_shards

    path = dirs[name]
    files = _files(path)
    assert len(files) > 1 or name == "fp8"
    with counting() as (reads, resolves):
        whole = load_pretrained(path, task="causal-lm", **kw)
    assert {f: reads[f] for f in files} == dict.fromkeys(files, 1) and resolves == [1], (reads, resolves)
    with counting() as (reads, resolves):  # as the Trainer runs it: built on meta from the headers, then read
        lean = lean_pretrained(path, "causal-lm", None, **kw)
        assert lean is not None
        read_shards(lean, path)
    assert {f: reads[f] for f in files} == dict.fromkeys(files, 1) and resolves == [1], (reads, resolves)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                                                    b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k])
                                        for k in a)
    with counting() as (reads, resolves):  # `kiln plan`'s look: the headers only
        index = CheckpointIndex.open(path)
        index.headers()
        read_plan(index, "causal-lm", kw.get("fp8", "dequantize"), kw.get("quantize"))
    assert {f: reads[f] for f in files} == dict.fromkeys(files, 1) and resolves == [1], (reads, resolves)


def test_a_file_rewritten_after_its_header_was_read_is_read_afresh(dirs, tmp_path):
    """A read after the model was built checks the files against what they hold now (one stat each): a rewritten
    file's header is read again, and its changed tensor is named."""
    import shutil

    from kiln.parallel.sharded_load import lean_pretrained, read_shards

    path = tmp_path / "st"
    shutil.copytree(dirs["safetensors"], path)
    lean = lean_pretrained(path, "causal-lm", None)
    f = next(p for p in sorted(path.glob("*.safetensors")) if any(k.endswith("q_proj.weight") for k in tensor_spans(p)))
    state = safetensors.torch.load_file(str(f))
    key = next(k for k in state if k.endswith("q_proj.weight"))
    save_file({**state, key: state[key][:-1]}, str(f), metadata={"format": "pt"})
    with counting() as (reads, _), pytest.raises(WeightsError, match=rf"{key}.*shape \(63, 32\).*expects \(64, 32\)"):
        read_shards(lean, path)
    assert dict(reads) == {f.name: 1}


def _write_raw(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header,data,why", [
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 12, "end at byte"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 4, "do not hold"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8, "gap or overlap"),
    (b'{"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, "no readable dtype"),
    (b'[1, 2]', b"", "not a JSON object"),
])
def test_a_header_the_safetensors_library_refuses_is_named_once(tmp_path, header, data, why):
    """The checks `safe_open` makes on open, made by the one header read: so no later read meets them."""
    f = _write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(WeightsError, match=rf"model\.safetensors: not a readable safetensors file \(.*{why}"):
        tensor_spans(f)
    with pytest.raises(safetensors.SafetensorError):  # the library refuses the same file
        safetensors.safe_open(str(f), framework="pt")


def test_the_index_reads_what_the_library_reads(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(6, 9, generator=g).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int64),
             "e": torch.zeros(0, 3), "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)}
    save_file(state, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex(tmp_path)
    got = index.load_all()
    assert list(got) == sorted(state)  # in name order, as safe_open lists them
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
        assert torch.equal(index.read(k).view(torch.uint8), t.view(torch.uint8))


# ---- what a load leaves on the model: declared, nothing else ---------------------------------------------------
OLD_ATTRIBUTES = ("pending_read", "pending_seed", "source_task", "q4_read", "unheld_fp8", "fresh_names", "fresh_rng",
                  "carried_refs", "fp8_refs")


def test_the_old_undeclared_load_attributes_are_gone_from_kiln():
    """The attributes the two loading paths passed on the model (now kiln.models.load_plan.DeferredRead's and
    Carried's fields, held in `deferred_read` and `carried`) are neither set nor read on a model anywhere in kiln/."""
    import re

    kiln_dir = Path(__file__).resolve().parents[2] / "kiln"
    names = "|".join(OLD_ATTRIBUTES)
    on_model = re.compile(rf"(?<![\w.])(model|self|lean|m)\.({names})\b|[\"']({names})[\"']")
    found = [f"{p.relative_to(kiln_dir)}:{i}: {line.strip()}" for p in sorted(kiln_dir.rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if on_model.search(line)]
    assert found == [], "\n".join(found)
    assert on_model.search("    model.pending_read = path") and on_model.search('getattr(m, "fp8_refs", None)')


@pytest.mark.parametrize("name,kw", [("safetensors", {}), ("fp8", {"fp8": "keep"}), ("safetensors", {"quantize": "nf4"})])
def test_a_sharded_load_leaves_only_declared_attributes_on_the_model(dirs, name, kw):
    from kiln.models.auto import load_config
    from kiln.models.pretrained import PreTrainedModel
    from kiln.parallel.sharded_load import lean_pretrained, read_shards

    family, config, _task = load_config(dirs[name])
    with torch.device("meta"):
        built = family.build(config, "causal-lm")
    declared = set(vars(built)) | set(PreTrainedModel.__annotations__)
    lean = lean_pretrained(dirs[name], "causal-lm", None, **kw)
    assert set(vars(lean)) <= declared, set(vars(lean)) - declared
    assert lean.deferred_read is not None and lean.deferred_read.index.root == dirs[name]
    read_shards(lean, dirs[name])
    assert set(vars(lean)) <= declared and lean.deferred_read is None, set(vars(lean)) - declared
