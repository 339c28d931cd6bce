"""A sharded run's export (`kiln export --checkpoint`) of a release whose family's own load decided something
(Qwen3.5-MoE's fused experts, carried MTP tensors; DeepSeek-V4's release names and bfloat16 with float32-held
parameters) writes what a one-process export of the same weights writes: names, split, dtypes, bytes."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.interop.export import export_model
from kiln.parallel.checkpoint import export_sharded, save_sharded
from kiln.parallel.sharded_carried import CARRIED_FILE
from kiln.parallel.sharded_load import lean_pretrained, read_shards
from tests.parallel import sharded_load_workers as sw
from tests.parallel.test_sharded_load import hook_dirs  # noqa: F401  (a fixture)
from tests.spawn import spawn


def _files(d) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - safe_open: no __iter__
    return out


@pytest.fixture(scope="module")
def runs(hook_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("hook_export")
    mtp = root / "fused-mtp"  # the fused release with an MTP tensor its family carries (hf_passthrough)
    shutil.copytree(hook_dirs["fused"], mtp)
    state = load_file(str(mtp / "model.safetensors"))
    extra = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({**state, "mtp.fc.weight": extra}, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    srcs = {"fused": hook_dirs["fused"], "fused-mtp": mtp, "v4": hook_dirs["v4"], "v3mtp": hook_dirs["v3mtp"],
            "v4mtp": hook_dirs["v4mtp"]}
    spawn(sw.save_sharded_runs, 2, ([(str(src), str(root / name / "ckpt")) for name, src in srcs.items()],))
    return root, srcs


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,stream", [("fused", None, True), ("fused-mtp", None, True),
                                               ("fused", torch.bfloat16, True), ("v4", None, True),
                                               ("fused-mtp", None, False), ("v4", None, False),
                                               ("v3mtp", None, True), ("v3mtp", None, False)])
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
    if name == "v3mtp":  # the MTP layer was read by reference: the shards hold none of its bytes, the export all
        assert any(k.startswith("model.layers.2.") for k in names)
        assert (root / name / "ckpt" / "model" / CARRIED_FILE).is_file() and not _dcp_carried(root / name / "ckpt")
    if name == "v4":
        floats = {t.dtype for f in want.values() for t in f.values() if t.is_floating_point()}
        assert "embed.weight" in names and floats == {torch.bfloat16}
    if stream:  # still streamed: about one output file at a time
        assert stats["peak_bytes"] < stats["model_bytes"] / 2, stats


@pytest.mark.slow
def test_a_dequantized_sharded_run_exports_the_fp8_mtp_layer_dequantized_as_one_process(runs, tmp_path):
    """A DeepSeek-V4 FP8 release read shard by shard to dequantize (the default) under FSDP2 held its MTP layer by
    reference, each FP8 / FP4 weight as its stored pair. Its export writes no `quantization_config` (the run kept no
    FP8 pairs of its main weights), so the MTP layer goes out dequantized, each pair as it is read, as the run's
    one-process export of the same weights held dequantized writes it: names, split, dtypes, bytes, config. It used
    to write the release's FP8 / FP4 MTP bytes under that config: the export then failed to train its MTP layer."""
    from kiln.models.auto import load_whole
    from kiln.models.common.fp8 import dequantize_model

    root, srcs = runs
    ckpt = root / "v4mtp" / "ckpt"
    assert (ckpt / "model" / CARRIED_FILE).is_file() and not _dcp_carried(ckpt)  # read by reference, not whole
    released = _mtp(_files(srcs["v4mtp"]))
    assert {t.dtype for t in released.values()} >= {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8}
    whole = load_whole(srcs["v4mtp"], task="causal-lm")  # what one process holds: dequantized, pairs aside
    export_model(dequantize_model(whole), tmp_path / "one", max_shard_bytes=100_000)
    want = _files(tmp_path / "one")
    assert {t.dtype for t in _mtp(want).values()} == {torch.bfloat16, torch.float32} and len(want) > 2
    for stream in (True, False):
        out = export_sharded(ckpt, tmp_path / f"sharded-{stream}", max_shard_bytes=100_000, stream=stream)
        got = _files(out)
        assert {f: list(t) for f, t in got.items()} == {f: list(t) for f, t in want.items()}, stream
        assert _differ(_flat(got), _flat(want)) == [], stream
        assert (out / "config.json").read_text() == (tmp_path / "one" / "config.json").read_text()
    # reloaded, its MTP layer trains: its parameters are those the run's whole load makes live
    again = load_whole(tmp_path / "sharded-True", task="causal-lm")
    again.enable_mtp("export")
    whole.enable_mtp("release")
    a, b = again.state_dict(), whole.state_dict()
    assert "mtp.0.mlp.experts.gate_up_proj" in a and _differ(a, b) == []
    ids = torch.randint(5, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    again.train()
    again(input_ids=ids, labels=ids)
    total, count = again.mtp_loss_parts
    assert int(count) > 0 and torch.isfinite(total)


def _flat(files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: t for tensors in files.values() for k, t in tensors.items()}


def _mtp(files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: t for tensors in files.values() for k, t in tensors.items() if k.startswith("mtp.")}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names only one side has, or whose tensors differ in dtype, shape or bytes."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return sorted(a.keys() ^ b.keys()) + sorted(k for k in a.keys() & b.keys() if (a[k].dtype, a[k].shape)
                                                != (b[k].dtype, b[k].shape) or not torch.equal(raw(a[k]), raw(b[k])))


def _dcp_carried(ckpt) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return [k for k in dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
            if k.startswith("carried.")]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a sharded save in one process, meant
def test_a_carried_tensor_whose_source_is_gone_or_changed_is_named_at_export(hook_dirs, tmp_path):
    """A run read shard by shard recorded where its MTP layer lies, not its bytes: exporting after the source file
    changed or went away names the tensor and the file, and writes nothing."""
    src = tmp_path / "src"
    shutil.copytree(hook_dirs["v3mtp"], src)
    model = lean_pretrained(src, "causal-lm", None)
    read_shards(model, src)
    save_sharded(tmp_path / "ckpt", model)  # one process, no group: the same shards and references
    export_sharded(tmp_path / "ckpt", tmp_path / "ok", max_shard_bytes=20_000)
    held = {r.file for r in model.carried.refs.values()}
    f = src / sorted(held)[0]
    f.touch()  # the same bytes, a new mtime: the run's source cannot be vouched for
    with pytest.raises(KilnError, match=rf"carried tensor 'layers\.2\.[\w.]+' \(hf_extras\).*{f.name}.*changed since"):
        export_sharded(tmp_path / "ckpt", tmp_path / "changed", max_shard_bytes=20_000)
    assert not (tmp_path / "changed").exists()  # refused before the first file
    f.unlink()
    with pytest.raises(KilnError, match=rf"carried tensor 'layers\.2\.[\w.]+'.*{f.name}, which is missing"):
        export_sharded(tmp_path / "ckpt", tmp_path / "missing", max_shard_bytes=20_000, stream=False)
