"""The non-finite guard: a NaN loss is skipped and counted, or stops the run with the last good checkpoint intact."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import KilnError
from kiln.models.auto import from_config
from kiln.train import Callback, Trainer
from kiln.train.checkpoint import verify_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.steps import default_step
from tests.train.train_helpers import tiny_config


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 99, (6,), generator=g), "labels": torch.tensor(i % 3)} for i in range(32)]


def _nan_at(step_no: int):
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        loss_sum, count = default_step(model, batch)
        return (loss_sum * float("nan"), count) if calls["n"] == step_no else (loss_sum, count)
    return step


def _model():
    return from_config(tiny_config(), task="sequence-classification", seed=0)


def test_nan_loss_is_skipped_and_counted(tmp_path):
    seen = {}

    class Watch(Callback):  # weights before and after the poisoned step
        def on_step(self, trainer, record):
            seen[record["step"]] = trainer.unwrapped().head.classifier.weight.detach().clone()

    t = Trainer(_model(), _data(), step=_nan_at(3), callbacks=[Watch()], steps=6, batch_size=4, lr=1e-3,
                out_dir=str(tmp_path), progress=False).fit()
    assert t.skipped == 1
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert math.isnan(recs[2]["loss"]) and recs[2]["skipped"] == 1 and recs[1]["skipped"] == 0
    assert torch.equal(seen[2], seen[3])            # the NaN step changed nothing
    assert not torch.equal(seen[3], seen[4])        # training went on
    assert all(torch.isfinite(p).all() for p in t.unwrapped().parameters())


def test_nan_loss_in_fail_mode_stops_with_message_and_keeps_last_checkpoint(tmp_path):
    t = Trainer(_model(), _data(), step=_nan_at(5), steps=8, batch_size=4, save_every=2, non_finite="fail",
                out_dir=str(tmp_path), progress=False)
    with pytest.raises(KilnError, match=r"non-finite loss nan at step 5; stopping \(train.non_finite = 'fail'\)\. "
                                        r"Last good checkpoint: ckpt-000004"):
        t.fit()
    assert verify_checkpoint(tmp_path / "ckpt-000004") is None
    assert not list(tmp_path.glob("*ckpt-000005*"))
