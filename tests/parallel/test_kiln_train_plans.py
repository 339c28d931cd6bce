"""`kiln train` runs the [parallel] plans: fsdp, tp = 2 and ep = 2 over 2 gloo processes equal one process
on the same global batch; a sharded run SIGKILLed and resumed ends bit-identical to the uninterrupted one,
and `kiln export --checkpoint` of its sharded checkpoint passes verify-export.

Tiny qwen3 / qwen3_moe SFT runs built from config (packed chat rows: every token counts, no padding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.hub import load_weights
from kiln.interop.verify import verify_export
from kiln.parallel.checkpoint import is_sharded
from kiln.train.checkpoint import verify_checkpoint
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import DENSE, launch, losses, make_data, run_toml, weights

MOE = {**DENSE, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "mlp_only_layers": []}
STEPS, GLOBAL_BATCH = 4, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("plans"))


def _toml(d: Path, name: str, family: str, batch_size: int, parallel: dict, grad_accum: int = 1) -> Path:
    return run_toml(d, name, parallel, family=family, config=DENSE if family == "qwen3" else MOE,
                    train={"steps": STEPS, "batch_size": batch_size, "grad_accum": grad_accum, "keep_last": 5})


@pytest.fixture(scope="module")
def references(setup) -> dict[str, Path]:
    """One process, the global batch, no plan."""
    runs = {}
    for family in ("qwen3", "qwen3_moe"):
        build_trainer(load_run_config(_toml(setup, f"one-{family}", family, GLOBAL_BATCH, {}))).fit()
        runs[family] = setup / f"one-{family}"
    return runs


def _same_as_one_process(run: Path, ref: Path, tmp: Path) -> None:
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(ref)), rtol=1e-5, atol=1e-6)
    assert len(losses(run)) == STEPS
    end = f"ckpt-{STEPS:06d}"
    assert is_sharded(run / end) and verify_checkpoint(run / end) is None
    got, want = weights(run / end, tmp), weights(ref / end, tmp)
    assert got.keys() == want.keys()
    start = weights(ref / "ckpt-000002", tmp)
    assert any(not torch.equal(want[k], start[k]) for k in want)  # the run moved the weights
    for k in want:
        # AdamW moves near-zero gradients by about lr * sign: fp32 rounding shows as ~1e-5 there
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name,family,batch_size,parallel", [
    # tp ranks read the same rows; blocks recomputed in the backward (activation checkpointing via kiln train)
    ("tp", "qwen3", GLOBAL_BATCH, {"tp": 2, "activation_checkpointing": "block"}),
    ("ep", "qwen3_moe", GLOBAL_BATCH // 2, {"ep": 2}),  # ep ranks split the batch
], ids=["tp2", "ep2"])
@pytest.mark.slow
def test_kiln_train_plan_equals_one_process(setup, references, tmp_path, name, family, batch_size, parallel):
    p = launch(_toml(setup, name, family, batch_size, parallel))
    assert p.returncode == 0, p.stderr[-3000:]
    _same_as_one_process(setup / name, references[family], tmp_path)


@pytest.mark.slow
def test_fsdp_killed_and_resumed_equals_uninterrupted_and_one_process(setup, references, tmp_path):
    # 2 ranks x 2 micro-batches of 1 row: FSDP skips the gradient reduce-scatter on the first micro-batch
    straight = _toml(setup, "fsdp", "qwen3", 1, {"fsdp": True}, grad_accum=2)
    p = launch(straight)
    assert p.returncode == 0, p.stderr[-3000:]
    _same_as_one_process(setup / "fsdp", references["qwen3"], tmp_path)

    cfg, run = _toml(setup, "fsdp-killed", "qwen3", 1, {"fsdp": True}, grad_accum=2), setup / "fsdp-killed"
    p = launch(cfg, env={"KILN_FAULT": "step:3"})  # rank 0 SIGKILLed after step 3; ckpt-000002 is the newest
    assert p.returncode != 0
    assert (run / "ckpt-000002").is_dir() and not (run / "ckpt-000004").exists()
    p = launch(cfg, "--resume", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from ckpt-000002" in p.stdout
    assert losses(run) == losses(setup / "fsdp")  # bit for bit, not within rounding
    a, b = weights(setup / "fsdp" / "ckpt-000004", tmp_path), weights(run / "ckpt-000004", tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)

    out = tmp_path / "export"
    p = kiln_cli("export", "--checkpoint", str(run / "ckpt-000004"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    checks = verify_export(out)
    assert checks and all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert all(torch.equal(load_weights(out)[k], v) for k, v in b.items())


def test_combinations_the_trainer_cannot_run_are_refused_by_key():
    from kiln.errors import ConfigError
    from kiln.train.config import ParallelSection
    from kiln.train.plans import check_plan

    check_plan(ParallelSection(cadence={}), "fp32", [], 2)  # runs as cadence rounds (test_kiln_train_cadence.py)
    with pytest.raises(ConfigError, match=r"train.precision = 'fp16' with parallel.fsdp"):
        check_plan(ParallelSection(fsdp=True), "fp16", [], 2)
    with pytest.raises(ConfigError, match=r"GrowthCallback reshapes the model"):
        check_plan(ParallelSection(activation_checkpointing="block"), "fp32", ["GrowthCallback"], 1)
    check_plan(ParallelSection(fsdp=True), "bf16", [], 2)  # what is supported passes
