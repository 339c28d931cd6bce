"""`kiln train` with [parallel] pp = 2 under `kiln launch`: losses, held-out loss and weights equal one process
on the same global batch within fp32 rounding; a run whose group is SIGKILLed resumes from its per-stage
checkpoint to the uninterrupted run's losses and weights bit for bit; `kiln export --checkpoint` gathers
the stages into one HF directory that passes verify-export (transformers loads it, outputs equal).

A tiny 4-block qwen3 SFT run built from config (packed chat rows), 2 micro-batches per batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.hub import load_weights
from kiln.interop.verify import verify_export
from kiln.parallel.checkpoint import export_sharded, is_sharded
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import CHATS, make_data, run_toml
from tests.parallel.sft_runs import DENSE as TWO_BLOCKS
from tests.parallel.sft_runs import launch as _launch

HELD_OUT = CHATS[:6]
DENSE = {**TWO_BLOCKS, "num_hidden_layers": 4}
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("pp"), CHATS, HELD_OUT)


def _toml(d: Path, name: str, parallel: dict) -> Path:
    return run_toml(d, name, parallel, config=DENSE, data={"eval": str(d / "eval.jsonl")},
                    train={"steps": STEPS, "grad_accum": 2, "keep_last": 5, "eval_every": 2})


def _records(run: Path, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


@pytest.mark.slow
def test_pp_train_equals_one_process_resumes_exactly_and_exports(setup, tmp_path):
    build_trainer(load_run_config(_toml(setup, "one", {}))).fit()
    p = _launch(_toml(setup, "pp", {"pp": 2, "microbatches": 2}))
    assert p.returncode == 0, p.stderr[-3000:]
    one, pp = setup / "one", setup / "pp"
    assert len(_records(pp, "loss")) == STEPS
    torch.testing.assert_close(torch.tensor(_records(pp, "loss")), torch.tensor(_records(one, "loss")),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(_records(pp, "eval_loss")), torch.tensor(_records(one, "eval_loss")),
                               rtol=1e-5, atol=1e-6)
    end = f"ckpt-{STEPS:06d}"
    assert is_sharded(pp / end)
    got = load_weights(export_sharded(pp / end, tmp_path / "gathered"))
    want = load_weights(one / end / "model")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")

    cfg, run = _toml(setup, "pp-killed", {"pp": 2, "microbatches": 2}), setup / "pp-killed"
    p = _launch(cfg, env={"KILN_FAULT": "step:3"})  # rank 0 SIGKILLed after step 3: the group goes down
    assert p.returncode != 0
    assert (run / "ckpt-000002").is_dir() and not (run / end).exists()
    p = _launch(cfg, "--resume", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from ckpt-000002" in p.stdout
    assert _records(run, "loss") == _records(pp, "loss")  # bit for bit
    assert _records(run, "eval_loss") == _records(pp, "eval_loss")
    again = load_weights(export_sharded(run / end, tmp_path / "gathered-again"))
    # bit for bit: each stage keeps its own optimizer hyperparameters through the resume (fused AdamW and the
    # plain one differ in the last bit, which is how a stage that lost them showed)
    assert again.keys() == got.keys() and all(torch.equal(again[k], got[k]) for k in got)
    out = tmp_path / "export"
    p = kiln_cli("export", "--checkpoint", str(run / end), "--out", str(out))
    assert p.returncode == 0, p.stderr
    exported = load_weights(out)
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in again)
    checks = verify_export(out)
    assert checks and all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
