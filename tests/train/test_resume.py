"""Crash safety: SIGKILL mid-run and mid-checkpoint, resume, and end exactly where an uninterrupted run ends."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kiln.errors import KilnError
from kiln.train.checkpoint import latest_checkpoint
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.train_helpers import TINY, kiln, make_rows, write_jsonl, write_toml


def _curve(run: Path) -> list[tuple]:
    """Every metrics line minus its wall-clock fields."""
    return [tuple(sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))) for r in read_metrics(run / "metrics.jsonl")]


def _weights(ckpt: Path) -> dict:
    return load_file(str(ckpt / "model" / "model.safetensors"))


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_matches_uninterrupted(tmp_path, tiny_dir, data_files):
    train, eval_ = data_files
    ref = write_toml(tmp_path / "ref.toml", tiny_dir, train, eval_, tmp_path / "ref")
    kiln("train", "--config", str(ref))

    cfg = write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "run")
    run = tmp_path / "run"
    # 1) killed between optimizer steps (after step 6; the newest checkpoint is step 4)
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:6"}, check=False)
    assert p.returncode == -9, p.stderr
    assert len(read_metrics(run / "metrics.jsonl")) > 6   # lines past the checkpoint exist and must be cut
    # 2) resumed, then killed while writing ckpt-000008 (weights written, no manifest, not renamed)
    p = kiln("train", "--config", str(cfg), "--resume", str(run), env={"KILN_FAULT": "ckpt:8"}, check=False)
    assert p.returncode == -9, p.stderr
    assert (run / ".ckpt-000008.tmp" / "model" / "model.safetensors").is_file()
    assert not (run / "ckpt-000008").exists()
    # 3) resumed again: the partial write is reported by name and ckpt-000004 is used
    p = kiln("train", "--config", str(cfg), "--resume", str(run))
    assert ".ckpt-000008.tmp: partial checkpoint write" in p.stdout
    assert "from ckpt-000004" in p.stdout

    for step in (4, 8, 12):
        a, b = _weights(tmp_path / "ref" / f"ckpt-{step:06d}"), _weights(run / f"ckpt-{step:06d}")
        assert a.keys() == b.keys()
        assert all((a[k] == b[k]).all() for k in a), f"weights differ at step {step}"
    assert _curve(run) == _curve(tmp_path / "ref")
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]) == 12


@pytest.mark.slow
def test_resume_before_the_first_save_starts_at_step_zero_and_says_so(tmp_path, tiny_dir, data_files):
    """One restart command for every crash: killed before its first checkpoint, `--resume` starts over."""
    train, eval_ = data_files
    ref = write_toml(tmp_path / "ref.toml", tiny_dir, train, eval_, tmp_path / "ref", steps=6)
    kiln("train", "--config", str(ref))
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "run", steps=6)
    run = tmp_path / "run"
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:3"}, check=False)
    assert p.returncode == -9, p.stderr
    assert latest_checkpoint(run, lambda _: None) is None and len(read_metrics(run / "metrics.jsonl")) >= 3
    p = kiln("train", "--config", str(cfg), "--resume", str(run))
    assert f"resume: {run} holds no complete checkpoint yet; starting from step 0" in p.stdout
    assert _curve(run) == _curve(tmp_path / "ref")  # the lost attempt's lines are gone, none doubled


def test_resume_from_another_directory_without_a_checkpoint_is_refused(tmp_path):
    """Only the run's own out_dir restarts from step 0; a Trainer pointed at some other directory is refused."""
    import torch

    from kiln.train import Trainer

    (tmp_path / "other").mkdir()
    data = [{"x": torch.randn(3), "labels": torch.randn(1)} for _ in range(8)]
    trainer = Trainer(torch.nn.Linear(3, 1), data, step=lambda m, b: ((m(b["x"]) - b["labels"]) ** 2).mean(),
                      steps=2, batch_size=4, out_dir=str(tmp_path / "run"), resume=tmp_path / "other", progress=False)
    with pytest.raises(KilnError, match="other: no complete checkpoint to resume from"):
        trainer.fit()


def test_corrupt_newest_checkpoint_is_named_and_previous_used(tmp_path, tiny_dir, data_files):
    train, eval_ = data_files
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "run", steps=8))
    build_trainer(cfg).fit()
    newest = tmp_path / "run" / "ckpt-000008" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")
    notes: list[str] = []
    assert latest_checkpoint(tmp_path / "run", notes.append).name == "ckpt-000004"
    assert notes == ["ckpt-000008: optimizer.safetensors does not match its checksum; using the previous checkpoint"]


def test_resume_refuses_changed_model_data_or_dtype(tmp_path, tiny_dir, data_files):
    train, eval_ = data_files
    path = write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "run", steps=4)
    build_trainer(load_run_config(path)).fit()
    run = tmp_path / "run"

    cfg = load_run_config(path)  # the same model built from scratch, with a wider MLP
    cfg.model = cfg.model.model_copy(update={"path": None, "family": "bert", "tokenizer": str(tiny_dir),
                                             "config": {**TINY, "intermediate_size": 40}})
    with pytest.raises(KilnError, match=r"model shape changed: model.layers.0.mlp.+\(37,\) -> \(40,\)"):
        build_trainer(cfg, resume=run).fit()

    other = write_jsonl(tmp_path / "other.jsonl", make_rows(48, 9))
    cfg = load_run_config(write_toml(tmp_path / "b.toml", tiny_dir, other, eval_, run, steps=4))
    with pytest.raises(KilnError, match=r"data source changed: train "):
        build_trainer(cfg, resume=run).fit()

    cfg = load_run_config(write_toml(tmp_path / "c.toml", tiny_dir, train, eval_, run, steps=4, precision="bf16"))
    with pytest.raises(KilnError, match=r"precision changed: fp32 -> bf16"):
        build_trainer(cfg, resume=run).fit()


def test_keep_last_and_best_survive_pruning(tmp_path, tiny_dir, data_files):
    train, eval_ = data_files
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "run", steps=16,
                                     save_every=2, eval_every=2, keep_last=2, best_metric="eval_loss",
                                     best_mode="min"))
    t = build_trainer(cfg).fit()
    names = sorted(p.name for p in (tmp_path / "run").glob("ckpt-*"))
    best = t.best["checkpoint"]
    assert set(names) == {"ckpt-000014", "ckpt-000016", best}
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in r]
    assert min(evals, key=lambda r: r["eval_loss"])["step"] == t.best["step"]
    shutil.rmtree(tmp_path / "run")
