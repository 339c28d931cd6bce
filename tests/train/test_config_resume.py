"""`build_trainer(cfg, resume=RUN_DIR)` from Python does what `kiln train --resume` does: the per-process
batch size that keeps the checkpoint's global batch (the TOML may hold another, e.g. after a reshard),
and the [parallel] degrees checked against the world before any model work."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError, KilnError
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.train.train_helpers import write_toml


def test_resume_from_python_keeps_the_checkpoints_global_batch(tmp_path, tiny_dir, data_files, capsys):
    train, eval_ = data_files
    run = tmp_path / "run"
    build_trainer(load_run_config(write_toml(tmp_path / "a.toml", tiny_dir, train, eval_, run, steps=4,
                                             batch_size=2))).fit()
    capsys.readouterr()
    cfg = load_run_config(write_toml(tmp_path / "b.toml", tiny_dir, train, eval_, run, steps=6, batch_size=4))
    trainer = build_trainer(cfg, resume=run)
    assert trainer.args.batch_size == 2
    assert "resume: train.batch_size 4 -> 2 per process, as ckpt-000004 was trained" in capsys.readouterr().out
    assert trainer.fit().step == 6
    # the control: asked to keep the config's batch size (kiln train --set train.batch_size=4), the
    # changed batch size breaks exactness and the resume is refused
    with pytest.raises(KilnError, match=r"cannot resume .*train\.batch_size 2 -> 4"):
        build_trainer(cfg, resume=run, keep_global_batch=False).fit()


def test_degrees_that_do_not_fit_the_world_fail_before_any_model_work(tmp_path, data_files):
    train, _ = data_files
    toml = write_toml(tmp_path / "run.toml", tmp_path / "no-model-here", train, None, tmp_path / "run")
    toml.write_text(toml.read_text() + "\n[parallel]\ntp = 2\n")
    with pytest.raises(ConfigError, match=r"parallel degrees tp \(2\) = 2 do not divide the world size \(1"):
        build_trainer(load_run_config(toml))  # the model path does not exist: no model was read
