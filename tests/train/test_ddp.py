"""DDP: `kiln launch` with 2 gloo processes on CPU equals one process with the same global batch,
including when the DDP run is killed and resumed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.train.metrics import read_metrics
from tests.train.train_helpers import kiln, write_toml


def _losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_and_resume(tmp_path, tiny_dir_nodrop, data_files):
    train, eval_ = data_files
    common = dict(steps=8, save_every=4, eval_every=4)
    one = write_toml(tmp_path / "one.toml", tiny_dir_nodrop, train, eval_, tmp_path / "one", batch_size=8, **common)
    kiln("train", "--config", str(one))

    two = write_toml(tmp_path / "two.toml", tiny_dir_nodrop, train, eval_, tmp_path / "two", batch_size=4, **common)
    launch = ("launch", "--nproc-per-node", "2", "--", "train", "--config", str(two))
    p = kiln(*launch, env={"KILN_FAULT": "step:6"}, check=False)
    assert p.returncode != 0
    assert (tmp_path / "two" / "ckpt-000004").is_dir() and not (tmp_path / "two" / "ckpt-000008").exists()
    p = kiln(*launch[:-2], "--config", str(two), "--resume", str(tmp_path / "two"))
    assert "from ckpt-000004" in p.stdout

    for step in (4, 8):
        a = load_file(str(tmp_path / "one" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(tmp_path / "two" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=f"{k} at step {step}")
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "two")), torch.tensor(_losses(tmp_path / "one")),
                               rtol=1e-5, atol=1e-6)
    assert len(_losses(tmp_path / "two")) == 8
    evals = [r for r in read_metrics(tmp_path / "two" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
