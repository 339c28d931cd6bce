"""A sharded run's export (`kiln export --checkpoint`) of a release whose family's own load decided something
(Qwen3.5-MoE's fused experts, carried MTP tensors; DeepSeek-V4's release names and bfloat16 with float32-held
parameters) writes what a one-process export of the same weights writes: names, split, dtypes, bytes."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.interop.export import export_model
from kiln.parallel.checkpoint import export_sharded
from tests.parallel import sharded_load_workers as sw
from tests.parallel.test_sharded_load import hook_dirs  # noqa: F401  (a fixture)
from tests.spawn import spawn


def _files(d) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = {k: h.get_tensor(k) for k in h.keys()}
    return out


@pytest.fixture(scope="module")
def runs(hook_dirs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("hook_export")
    mtp = root / "fused-mtp"  # the fused release with an MTP tensor its family carries (hf_passthrough)
    shutil.copytree(hook_dirs["fused"], mtp)
    state = load_file(str(mtp / "model.safetensors"))
    extra = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({**state, "mtp.fc.weight": extra}, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    srcs = {"fused": hook_dirs["fused"], "fused-mtp": mtp, "v4": hook_dirs["v4"]}
    spawn(sw.save_sharded_runs, 2, ([(str(src), str(root / name / "ckpt")) for name, src in srcs.items()],))
    return root, srcs


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,stream", [("fused", None, True), ("fused-mtp", None, True),
                                               ("fused", torch.bfloat16, True), ("v4", None, True),
                                               ("fused-mtp", None, False), ("v4", None, False)])
def test_a_sharded_run_exports_as_one_process_exports(runs, name, dtype, stream, tmp_path):
    root, srcs = runs
    export_model(srcs[name], tmp_path / "one", max_shard_bytes=20_000, dtype=dtype)
    stats = {}
    export_sharded(root / name / "ckpt", tmp_path / "sharded", max_shard_bytes=20_000, dtype=dtype, stream=stream,
                   stats=stats)
    want, got = _files(tmp_path / "one"), _files(tmp_path / "sharded")
    assert len(want) > 2 and {f: list(t) for f, t in got.items()} == {f: list(t) for f, t in want.items()}
    for f, tensors in want.items():
        for k, t in tensors.items():
            assert got[f][k].dtype == t.dtype and got[f][k].shape == t.shape, (k, got[f][k].dtype, t.dtype)
            assert torch.equal(got[f][k].view(torch.uint8), t.view(torch.uint8)), k
    names = {k for t in want.values() for k in t}
    if name.startswith("fused"):
        assert any(k.endswith("experts.gate_up_proj") for k in names)
    if name == "fused-mtp":
        assert "mtp.fc.weight" in names
    if name == "v4":
        floats = {t.dtype for f in want.values() for t in f.values() if t.is_floating_point()}
        assert "embed.weight" in names and floats == {torch.bfloat16}
    if stream:  # still streamed: about one output file at a time
        assert stats["peak_bytes"] < stats["model_bytes"] / 2, stats
