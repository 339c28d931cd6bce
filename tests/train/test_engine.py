"""The step engine: one optimizer update in kiln, and every mode's metrics line carries the same core fields."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kiln.models.auto import AutoConfig, from_config
from kiln.train import Trainer
from kiln.train.config import CadenceSection, ParallelSection
from kiln.train.metrics import read_metrics
from kiln.train.recipes.ff import FFCallback, FFSection

KILN = Path(__file__).resolve().parents[2] / "kiln"
CORE = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "samples_per_s", "skipped", "epoch"}
OPTIMIZER_STEP = re.compile(r"\boptimizer\.step\(")


def _optimizer_steps(text: str) -> int:
    return len(OPTIMIZER_STEP.findall(text))


def test_one_optimizer_step_call_site_in_kiln():
    sites = [f"{p.relative_to(KILN)}" for p in sorted(KILN.rglob("*.py"))
             for _ in range(_optimizer_steps(p.read_text(encoding="utf-8")))]
    assert sites == ["train/trainer.py"], sites


def test_the_count_can_fail():
    assert _optimizer_steps("self.optimizer.step()\n    trainer.optimizer.step(closure)\nscaler.step(opt)") == 2


def _linear(out: Path, **kw) -> list[dict]:
    torch.manual_seed(0)
    data = [{"x": torch.randn(3), "labels": torch.randn(1)} for _ in range(16)]
    Trainer(torch.nn.Linear(3, 1), data, step=lambda m, b: ((m(b["x"]) - b["labels"]) ** 2).mean(), steps=4,
            batch_size=4, lr=0.05, out_dir=str(out), progress=False, save_at_end=False, **kw).fit()
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_plain_and_cadence_records_carry_the_core_fields(tmp_path):
    for name, kw in (("plain", {}), ("accum", {"grad_accum": 2}),
                     ("lockstep", {"parallel": ParallelSection(cadence=CadenceSection(max_batch_diff=0))}),
                     ("params", {"parallel": ParallelSection(cadence=CadenceSection(anchor=2))})):
        records = _linear(tmp_path / name, **kw)
        assert records and records[-1]["step"] == 4, name
        for r in records:
            assert set(r) >= CORE, (name, sorted(CORE - set(r)))
            assert r["grad_norm"] == r["grad_norm"] and r["grad_norm"] > 0, (name, r)  # not NaN, and moving


def test_ff_records_carry_the_core_fields_and_a_grad_norm(tmp_path):
    cfg = AutoConfig.for_model("mamba", vocab_size=99, hidden_size=32, num_hidden_layers=2, state_size=8,
                               conv_kernel=4)
    model = from_config(cfg, task="causal-lm", seed=0)
    torch.manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(1, 99, (12,))), "labels": ids} for _ in range(32)]
    Trainer(model, data, callbacks=[FFCallback(FFSection(bp_cadence_steps=2))], steps=4, batch_size=4, lr=1e-3,
            out_dir=str(tmp_path / "ff"), progress=False, save_at_end=False).fit()
    records = [r for r in read_metrics(tmp_path / "ff" / "metrics.jsonl") if "loss" in r]
    assert [("conflict_layers" in r) for r in records] == [False, True, False, True]  # FF steps, then backprop steps
    for r in records:
        assert set(r) >= CORE, sorted(CORE - set(r))
        assert r["tokens"] == 4 * 12 and r["grad_norm"] == r["grad_norm"]
