"""Sharded (DCP) checkpoints of an FSDP2 model: resume is exact; `kiln export` gathers one HF directory
that verify-export passes."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.hub import load_weights
from kiln.interop.verify import verify_export
from kiln.parallel.checkpoint import export_sharded, load_sharded
from tests.kiln_cli import kiln_cli
from tests.parallel import workers
from tests.spawn import spawn


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    spawn(workers.run_checkpoint, 2, (str(out), "straight", {"fsdp": True}))
    spawn(workers.run_checkpoint, 2, (str(out), "resume", {"fsdp": True}))
    return out


@pytest.mark.slow
def test_resume_from_sharded_checkpoint_is_exact(run):
    straight = torch.load(run / "straight.pt", weights_only=True)
    resumed = torch.load(run / "resume.pt", weights_only=True)
    assert (run / "ckpt-2" / "dcp" / "__0_0.distcp").is_file() and (run / "ckpt-2" / "dcp" / "__1_0.distcp").is_file()
    for name, w in straight["end"].items():
        assert torch.equal(w, resumed["end"][name]), name
    assert any(not torch.equal(straight["at_two"][n], w) for n, w in straight["end"].items())


@pytest.mark.slow
def test_export_gathers_an_hf_directory_that_verifies(run, tmp_path):
    out = export_sharded(run / "ckpt-2", tmp_path / "hf")
    checks = verify_export(out)
    assert checks and all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    at_two = torch.load(run / "straight.pt", weights_only=True)["at_two"]
    model = workers.build("qwen3")
    model.load_state_dict(at_two)
    hf = load_weights(out)
    for name, tensor in model.hf_state_dict().items():
        assert torch.equal(hf[name], tensor), name
    p = kiln_cli("export", "--checkpoint", str(run / "ckpt-2"), "--out", str(tmp_path / "cli"))
    assert p.returncode == 0, p.stderr
    assert all(torch.equal(load_weights(tmp_path / "cli")[k], v) for k, v in hf.items())
    p = kiln_cli("export", "--checkpoint", str(run / "ckpt-2"), "--out", str(tmp_path / "bf16"), "--dtype", "bf16")
    assert p.returncode == 0, p.stderr
    half = load_weights(tmp_path / "bf16")
    assert set(half) == set(hf) and all(torch.equal(half[k], v.to(torch.bfloat16)) for k, v in hf.items())


def test_not_a_sharded_checkpoint(tmp_path):
    with pytest.raises(KilnError, match="not a sharded checkpoint"):
        export_sharded(tmp_path, tmp_path / "out")
    with pytest.raises(KilnError, match="not a sharded checkpoint"):
        load_sharded(tmp_path, workers.build("qwen3"))
