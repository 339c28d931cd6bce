"""An FP8 release's multi-token-prediction layer under a read shard by shard, in one process (DeepSeek-V4's `mtp.*`,
DeepSeek-V3's layer num_hidden_layers): carried, each FP8 (FP4) weight is held by reference as its stored pair, weight
and scale (kiln.parallel.sharded_carried), and exported as released (kept FP8) or dequantized pair by pair (an
export that writes no FP8), as one process's export writes it; made live (`[moe] mtp_weight`), its parameters
are read dequantized piece by piece as the whole load's enable_mtp holds them. V4 under FSDP2 on 2 ranks, and its
sharded export's bytes: tests/parallel/test_sharded_load.py and test_sharded_hook_export.py (the `v4mtp` release)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from kiln.errors import KilnError
from kiln.models.auto import load_whole
from kiln.parallel.sharded_carried import CARRIED_FILE
from kiln.parallel.sharded_load import lean_pretrained, load_to_device, read_shards
from tests.models.v4_release import make_release, tiny_release_source
from tests.parallel.sharded_load_workers import _bits


@pytest.fixture(scope="module")
def release(tiny_factory, tmp_path_factory):
    """The tiny V4-Flash look-alike with its MTP layer: FP8 projections (e_proj, h_proj, attention, shared expert)
    with UE8M0 scales under `<module>.scale`, FP4 routed experts, float32 hyper-connections, bfloat16 norms."""
    return make_release(tiny_release_source(tiny_factory), tmp_path_factory.mktemp("v4mtp") / "flash")


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in dtype, shape or bytes (or that only one side has)."""
    return sorted(a.keys() ^ b.keys()) + [k for k in a.keys() & b.keys() if a[k].dtype != b[k].dtype
                                          or a[k].shape != b[k].shape or not torch.equal(_bits(a[k]), _bits(b[k]))]


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_the_fp8_mtp_layer_is_carried_by_reference_or_read_dequantized_once_live(release, fp8):
    with safe_open(str(release / "model.safetensors"), framework="pt") as h:
        stored = {k: h.get_slice(k) for k in h.keys() if k.startswith("mtp.")}  # noqa: SIM118 - safe_open: no __iter__
        stored = {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in stored.items()}
    whole = load_whole(release, task="causal-lm", fp8=fp8)
    lean = lean_pretrained(release, "causal-lm", None, fp8=fp8)
    assert lean is not None  # read shard by shard, not loaded whole
    read_shards(lean, release)
    assert lean.load_report.ignored == whole.load_report.ignored == []
    assert all(t.is_meta for t in lean.mtp_tensors.values())  # none of its bytes held
    # each carried tensor references its own checkpoint tensor as stored: FP8 weights and their scales too
    refs = {name: r for (holder, name), r in lean.carried.refs.items() if holder == "mtp_tensors"}
    assert list(refs) == list(lean.mtp_tensors) and {r.key for r in refs.values()} == set(stored)
    assert {r.dtype for r in refs.values()} >= {"float8_e4m3fn", "float8_e8m0fnu", "int8"}
    for name, r in refs.items():
        assert name == "model." + r.key and r.shape == stored[r.key][1], name
    # the whole load holds the weights dequantized (their pairs kept aside to write back), no scales
    assert whole.mtp_tensors.keys() == {n for n in refs if not n.endswith(".scale")}
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and _differ(a, b) == []
    one = load_to_device(release, "cpu", fp8=fp8)  # one process: the plan, then the carried pairs held dequantized
    assert one is not None and list(one.mtp_tensors) == list(whole.mtp_tensors)  # as the whole load holds them
    assert _differ(dict(one.mtp_tensors), dict(whole.mtp_tensors)) == [] and _differ(one.state_dict(), a) == []
    # made live before the read (`[moe] mtp_weight`): its parameters read as the whole load's enable_mtp holds them
    whole = load_whole(release, task="causal-lm", fp8=fp8)
    lean = lean_pretrained(release, "causal-lm", None, fp8=fp8)
    whole.enable_mtp("whole")
    lean.enable_mtp("lean")
    read_shards(lean, release)
    assert lean.mtp_tensors == {} and lean.load_report.ignored == []
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and "mtp.0.e_proj.weight" in a and _differ(a, b) == []
    assert b["mtp.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # FP4 experts dequantized, as whole


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a sharded save in one process, meant
def test_kept_fp8_a_sharded_checkpoint_exports_the_release_mtp_layer_and_all_as_one_process(release, tmp_path):
    """Kept FP8 (`fp8 = "keep"`), untrained: the sharded checkpoint's export writes every tensor of the release back
    byte for byte, as one process's export does; the MTP layer's pairs as carried (not also as pairs to write back:
    the packed FP4 experts would be quantized afresh from their bytes). Exported in one dtype, it writes what one
    process writes so: plain weights, the MTP layer dequantized (it wrote the release's FP8 MTP bytes)."""
    from kiln.interop.export import export_model
    from kiln.parallel.checkpoint import export_sharded, save_sharded

    lean = lean_pretrained(release, "causal-lm", None, fp8="keep")
    read_shards(lean, release)
    save_sharded(tmp_path / "ckpt", lean)  # one process, no group: the same shards and references
    export_sharded(tmp_path / "ckpt", tmp_path / "sharded", max_shard_bytes=100_000)
    export_model(load_whole(release, task="causal-lm", fp8="keep"), tmp_path / "one", max_shard_bytes=100_000)
    released, one, sharded = (_tensors(d) for d in (release, tmp_path / "one", tmp_path / "sharded"))
    assert any(k.startswith("mtp.") and t.dtype == torch.int8 for k, t in released.items())
    assert _differ(one, released) == [] and _differ(sharded, released) == []
    # in one dtype (`kiln export --dtype`): no FP8 written, the MTP layer's pairs dequantized as one process's too
    export_sharded(tmp_path / "ckpt", tmp_path / "sharded-bf16", max_shard_bytes=100_000, dtype=torch.bfloat16)
    export_model(load_whole(release, task="causal-lm", fp8="keep"), tmp_path / "one-bf16",
                 max_shard_bytes=100_000, dtype=torch.bfloat16)
    one, sharded = _tensors(tmp_path / "one-bf16"), _tensors(tmp_path / "sharded-bf16")
    assert not [k for k, t in one.items() if t.itemsize == 1] and _differ(sharded, one) == []


@pytest.fixture(scope="module")
def v3_release(tmp_path_factory):
    """A tiny DeepSeek-V3 FP8 release with its MTP layer (layer num_hidden_layers): FP8 Linears and experts with
    `weight_scale_inv` blocks, the MTP layer's too."""
    from safetensors.torch import load_file, save_file

    from tests.models.fp8_cases import make_fp8
    from tests.parallel.test_sharded_load import v3_with_mtp

    root = tmp_path_factory.mktemp("v3fp8mtp")
    src = v3_with_mtp(root / "bf16")
    state = {}
    for f in sorted(src.glob("*.safetensors")):  # make_fp8 reads one file
        state.update(load_file(str(f)))
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    return make_fp8(src, root / "fp8", "DeepseekV3ForCausalLM")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a sharded save in one process, meant
def test_a_v3_fp8_release_s_mtp_layer_is_carried_as_its_pairs_and_exported_as_one_process(v3_release, tmp_path):
    """DeepSeek-V3 (V3.2, GLM-5) carry their MTP layer in `hf_extras`: FP8 too, a read holds it as its stored pairs;
    the export of a run that dequantized (the default) writes no FP8, the MTP layer dequantized as one process's
    export of the weights it holds writes it, and kept FP8 the release's bytes; made live, its parameters read as
    the whole load's enable_mtp holds them."""
    from kiln.interop.export import export_model
    from kiln.models.common.fp8 import dequantize_model
    from kiln.parallel.checkpoint import export_sharded, save_sharded

    n = 2  # the tiny V3's num_hidden_layers: its MTP layer is model.layers.2.*
    whole = load_whole(v3_release, task="causal-lm")
    lean = lean_pretrained(v3_release, "causal-lm", None)
    assert lean is not None
    read_shards(lean, v3_release)
    assert lean.load_report.ignored == [] and all(t.is_meta for t in lean.hf_extras.values())
    assert {r.dtype for r in lean.carried.refs.values()} >= {"float8_e4m3fn", "float32"}
    assert whole.hf_extras.keys() == {k for k in lean.hf_extras if not k.endswith("_scale_inv")}
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and _differ(a, b) == []
    save_sharded(tmp_path / "ckpt", lean)  # one process, no group: the same shards and references
    export_sharded(tmp_path / "ckpt", tmp_path / "sharded", max_shard_bytes=60_000)
    export_model(dequantize_model(whole), tmp_path / "one", max_shard_bytes=60_000)
    one, sharded = _tensors(tmp_path / "one"), _tensors(tmp_path / "sharded")
    assert any(k.startswith(f"model.layers.{n}.") for k in one) and not [t for t in one.values() if t.itemsize == 1]
    assert _differ(sharded, one) == []  # every tensor: the MTP layer dequantized as one process holds it
    refs = tmp_path / "ckpt" / "model" / CARRIED_FILE  # a pair whose scale's reference is lost: named, not written
    rows = json.loads(refs.read_text())
    lost = next(r for r in rows if r["dequantized"])
    refs.write_text(json.dumps([r for r in rows if r["name"] != lost["dequantized"][0]]))
    with pytest.raises(KilnError, match=rf"FP8 weight {re.escape(repr(lost['name']))} \(hf_extras\) names its scale"):
        export_sharded(tmp_path / "ckpt", tmp_path / "lost", max_shard_bytes=60_000)
    kept = lean_pretrained(v3_release, "causal-lm", None, fp8="keep")
    read_shards(kept, v3_release)
    save_sharded(tmp_path / "kept", kept)
    export_sharded(tmp_path / "kept", tmp_path / "kept-sharded", max_shard_bytes=60_000)
    released, sharded = ({k: t for k, t in _tensors(d).items() if k.startswith(f"model.layers.{n}.")}
                         for d in (v3_release, tmp_path / "kept-sharded"))
    assert any(t.dtype == torch.float8_e4m3fn for t in released.values()) and _differ(sharded, released) == []
    whole = load_whole(v3_release, task="causal-lm")
    whole.enable_mtp("whole")
    lean = lean_pretrained(v3_release, "causal-lm", None)
    lean.enable_mtp("lean")
    read_shards(lean, v3_release)
    assert lean.hf_extras == {} and lean.load_report.ignored == []
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and f"model.layers.{n}.eh_proj.weight" in a and _differ(a, b) == []


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open: no __iter__
    return out
