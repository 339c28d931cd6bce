"""A DeepSeek-V4 release's FP8 multi-token-prediction layer under a read shard by shard, in one process: carried, each
FP8 (FP4) weight is held by reference as its stored pair, weight and scale (kiln.parallel.sharded_carried); made live
(`[moe] mtp_weight`), its parameters are read dequantized piece by piece as the whole load's enable_mtp holds them.
Under FSDP2 on 2 ranks, and the sharded export's bytes: tests/parallel/test_sharded_load.py and
test_sharded_hook_export.py (the `v4mtp` release)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kiln.models.auto import load_pretrained
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
        stored = {k: h.get_slice(k) for k in h.keys() if k.startswith("mtp.")}
        stored = {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in stored.items()}
    whole = load_pretrained(release, task="causal-lm", fp8=fp8)
    lean = lean_pretrained(release, "causal-lm", None, fp8=fp8)
    assert lean is not None  # read shard by shard, not loaded whole
    read_shards(lean, release)
    assert lean.load_report.ignored == whole.load_report.ignored == []
    assert all(t.is_meta for t in lean.mtp_tensors.values())  # none of its bytes held
    # each carried tensor references its own checkpoint tensor as stored: FP8 weights and their scales too
    refs = {name: r for (holder, name), r in lean.carried_refs.items() if holder == "mtp_tensors"}
    assert list(refs) == list(lean.mtp_tensors) and {r.key for r in refs.values()} == set(stored)
    assert {r.dtype for r in refs.values()} >= {"float8_e4m3fn", "float8_e8m0fnu", "int8"}
    for name, r in refs.items():
        assert name == "model." + r.key and r.shape == stored[r.key][1], name
    # the whole load holds the weights dequantized (their pairs kept aside to write back), no scales
    assert whole.mtp_tensors.keys() == {n for n in refs if not n.endswith(".scale")}
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and _differ(a, b) == []
    assert load_to_device(release, "cpu", fp8=fp8) is None  # one process exports from the pairs a whole load keeps
    # made live before the read (`[moe] mtp_weight`): its parameters read as the whole load's enable_mtp holds them
    whole = load_pretrained(release, task="causal-lm", fp8=fp8)
    lean = lean_pretrained(release, "causal-lm", None, fp8=fp8)
    whole.enable_mtp("whole")
    lean.enable_mtp("lean")
    read_shards(lean, release)
    assert lean.mtp_tensors == {} and lean.load_report.ignored == []
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and "mtp.0.e_proj.weight" in a and _differ(a, b) == []
    assert b["mtp.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # FP4 experts dequantized, as whole
