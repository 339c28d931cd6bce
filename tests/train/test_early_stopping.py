"""Early stopping with patience, best-checkpoint bookkeeping, and bf16 autocast on CPU."""

from __future__ import annotations

import json
import math

import torch

from kiln.models.auto import from_config
from kiln.train import Trainer
from kiln.train.metrics import read_metrics
from tests.train.train_helpers import tiny_config


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 99, (6,), generator=g), "labels": torch.tensor(i % 3)} for i in range(16)]


def test_patience_stops_and_best_is_kept(tmp_path):
    scores = iter([0.5, 0.7, 0.6, 0.65, 0.9])  # best at step 2, then two evals without improvement
    model = from_config(tiny_config(), task="sequence-classification", seed=0)
    t = Trainer(model, _data(), evaluate=lambda trainer: {"eval_accuracy": next(scores)}, steps=10, batch_size=4,
                eval_every=1, best_metric="eval_accuracy", early_stopping_patience=2, keep_last=1,
                out_dir=str(tmp_path), progress=False).fit()
    assert t.stopped_early and t.step == 4
    assert json.loads((tmp_path / "best.json").read_text()) == {"checkpoint": "ckpt-000002", "metric": "eval_accuracy",
                                                               "value": 0.7}
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000004"]
    assert [r["eval_accuracy"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_accuracy" in r] == \
        [0.5, 0.7, 0.6, 0.65]


def test_best_is_kept_by_validation_loss_when_best_metric_is_unset(tmp_path):
    losses = iter([2.0, 1.5, 1.7, 1.9])  # lowest at step 4 (eval_every 2)
    model = from_config(tiny_config(), task="sequence-classification", seed=0)
    t = Trainer(model, _data(), evaluate=lambda trainer: {"eval_loss": next(losses), "eval_accuracy": 0.5}, steps=8,
                batch_size=4, eval_every=2, save_every=100, keep_last=1, out_dir=str(tmp_path), progress=False).fit()
    assert json.loads((tmp_path / "best.json").read_text()) == {"checkpoint": "ckpt-000004", "metric": "eval_loss",
                                                               "value": 1.5}
    assert t.best["step"] == 4 and not t.stopped_early
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000008"]  # best + last kept
    # no eval_loss among the metrics, no best_metric: no best is tracked (control: it is the key that matters)
    t = Trainer(from_config(tiny_config(), task="sequence-classification", seed=0), _data(),
                evaluate=lambda trainer: {"eval_accuracy": 0.5}, steps=4, batch_size=4, eval_every=2,
                out_dir=str(tmp_path / "acc"), progress=False).fit()
    assert t.best is None and not (tmp_path / "acc" / "best.json").exists()


def test_bf16_autocast_on_cpu_trains(tmp_path):
    model = from_config(tiny_config(), task="sequence-classification", seed=0)
    t = Trainer(model, _data(), steps=3, batch_size=4, precision="bf16", out_dir=str(tmp_path), progress=False).fit()
    losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert next(t.unwrapped().parameters()).dtype == torch.float32  # autocast, not a cast of the weights
