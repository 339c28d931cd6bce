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


def test_bf16_autocast_on_cpu_trains(tmp_path):
    model = from_config(tiny_config(), task="sequence-classification", seed=0)
    t = Trainer(model, _data(), steps=3, batch_size=4, precision="bf16", out_dir=str(tmp_path), progress=False).fit()
    losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert next(t.unwrapped().parameters()).dtype == torch.float32  # autocast, not a cast of the weights
