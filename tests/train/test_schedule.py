"""Schedules, the weight-decay split, freezing, and `kiln plot`."""

from __future__ import annotations

import itertools
import math

import pytest

from kiln.models.auto import from_config
from kiln.train.optim import freeze, lr_factor, param_groups
from kiln.train.plot import plot_run
from tests.train.train_helpers import kiln, tiny_config


def test_warmup_then_cosine_to_floor():
    f = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in itertools.pairwise(f[1:])) and min(f) >= 0.1
    assert lr_factor(10, 10, 2, "linear", 0.2) == pytest.approx(0.2)
    assert lr_factor(6, 10, 2, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(7, 10, 0, "constant", 0.0) == 1.0


def test_no_decay_on_biases_and_norms_and_frozen_left_out():
    model = from_config(tiny_config(), task="sequence-classification", seed=0)
    frozen = freeze(model, ["model.embeddings", "model.layers.0.*"])
    assert "model.embeddings.word_embeddings.weight" in frozen and "model.layers.0.attn.q_proj.weight" in frozen
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"model.layers.1.attn_norm.weight", "head.classifier.bias"}
    assert not any(names[id(p)].startswith(("model.embeddings", "model.layers.0.")) for g in (decay, no_decay)
                   for p in g["params"])
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.01


def test_plot_writes_a_png(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "loss": {1 / s}, "lr": 0.001}}\n' for s in range(1, 6))
        + '{"step": 5, "eval_loss": 0.5, "eval_accuracy": 0.7}\n')
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = kiln("plot", str(tmp_path / "missing"), check=False)
    assert p.returncode == 1 and "no metrics.jsonl records to plot" in p.stderr
