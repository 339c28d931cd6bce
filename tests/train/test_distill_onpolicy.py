"""[distill] on-policy (GKD's lambda: `lmbda`) and a 4-bit teacher: the student's own completions (sampled on the
generation engine) scored by the teacher make the student's KL to the teacher fall; lmbda = 0 never samples; the
same seed gives the same run and another seed another; SIGKILL + resume is exact; a completion batch packed scores
as padded; teacher_quantize = "nf4" holds the teacher's Linears 4-bit and still teaches; bad settings refused by
message before work starts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError
from kiln.models.auto import load_pretrained
from kiln.models.common.fast import set_fast
from kiln.train.config import load_run_config
from kiln.train.grpo_engine import EngineRollouts
from kiln.train.metrics import read_metrics
from kiln.train.recipes.distill import DistillRun, DistillSection, completion_batch, prompts_of
from kiln.train.run import build_trainer
from tests.models.rounding import assert_within, rounding_error
from tests.train.test_distill import d, run_toml  # noqa: F401 (d: a fixture)


def on_policy_toml(d: Path, out: str, lines: str, steps: int = 12, seed: int = 1) -> Path:
    path = run_toml(d, out, d / "teacher", steps)
    text = path.read_text() + f"max_new_tokens = 8\n{lines}\n"  # [distill] is the last table
    path.write_text(text.replace("seed = 1\n", f"seed = {seed}\n"))
    return path


def fit(path: Path) -> tuple[list[dict], DistillRun]:
    trainer = build_trainer(load_run_config(path))
    run = next(cb for cb in trainer.callbacks if isinstance(cb, DistillRun))
    trainer.fit()
    return [r for r in read_metrics(path.parent / path.stem / "metrics.jsonl") if "loss" in r], run


def test_on_policy_the_students_kl_to_the_teacher_falls(d):
    """lmbda = 1: every micro-batch is the student's own completions (8 tokens after each prompt), the loss the
    forward KL on them (0.34 nat at the first step here); matching the teacher on its own
    samples brings the KL on its samples down by more than a third, and the held-out KL (the data rows, which it
    never trained on here) falls too."""
    rows, run = fit(on_policy_toml(d, "onpolicy", "lmbda = 1.0"))
    losses = [r["loss"] for r in rows]
    evals = [r["eval_loss"] for r in read_metrics(d / "onpolicy" / "metrics.jsonl") if "eval_loss" in r]
    print(f"on-policy KL {losses[0]:.4f} -> {losses[-1]:.4f}; held-out {evals}")
    assert run.on_policy == 12
    assert sum(losses[-3:]) / 3 < 0.67 * losses[0], losses
    assert evals[1] < evals[0], evals


def test_lmbda_zero_never_samples(d, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("lmbda = 0 sampled on the engine")

    monkeypatch.setattr(EngineRollouts, "run", refuse)
    rows, run = fit(on_policy_toml(d, "lmbda0", "lmbda = 0.0", steps=3))
    assert run.rollouts is None and run.on_policy == 0 and len(rows) == 3
    base, _ = fit(run_toml(d, "lmbda0-base", d / "teacher", 3))  # the run without the key: the same numbers
    assert [r["loss"] for r in rows] == [r["loss"] for r in base]


def test_the_same_seed_gives_the_same_run_and_another_seed_another(d):
    """lmbda = 0.5 over 6 steps: some micro-batches on-policy, some not (the coin's), equal run to run."""
    a, run_a = fit(on_policy_toml(d, "seed-a", "lmbda = 0.5", steps=6))
    b, run_b = fit(on_policy_toml(d, "seed-b", "lmbda = 0.5", steps=6))
    c, _ = fit(on_policy_toml(d, "seed-c", "lmbda = 0.5", steps=6, seed=2))
    assert 0 < run_a.on_policy < 6 and run_a.on_policy == run_b.on_policy
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


@pytest.mark.slow
def test_sigkill_then_resume_is_exact_on_policy(d):
    from safetensors.torch import load_file

    from tests.train.train_helpers import kiln

    kiln("train", "--config", str(on_policy_toml(d, "op-ref", "lmbda = 0.5")))
    cfg = on_policy_toml(d, "op-killed", "lmbda = 0.5")
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:9"}, check=False)
    assert p.returncode == -9, p.stderr
    p = kiln("train", "--config", str(cfg), "--resume", str(d / "op-killed"))
    assert "from ckpt-000006" in p.stdout
    a = load_file(str(d / "op-ref" / "ckpt-000012" / "model" / "model.safetensors"))
    b = load_file(str(d / "op-killed" / "ckpt-000012" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_completion_batch_packed_scores_as_padded(d):
    """The student's completions laid out packed (positions per sequence) or padded: the same divergence within
    fp32 rounding (estimated against the padded batch in float64), and the prompts read back from either."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (5, 9, 3, 7)]
    completions = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (8, 1, 6, 3)]
    teacher = set_fast(load_pretrained(d / "teacher", task="causal-lm")).eval()
    student = set_fast(load_pretrained(d / "student", task="causal-lm"))
    run = DistillRun(DistillSection(teacher=str(d / "teacher")), teacher, None)
    out = {}
    for name, pack, s, t in (("padded", False, student, teacher), ("packed", True, student, teacher),
                             ("float64", False, copy.deepcopy(student).double(), copy.deepcopy(teacher).double())):
        batch = completion_batch(prompts, completions, pack, 0)
        assert sorted(p.tolist() for p in prompts_of(batch)) == sorted(p.tolist() for p in prompts)  # any row order
        run.teacher = t
        with torch.no_grad():
            total, count = run.loss_sum(s, batch)
        assert int(count) == sum(len(c) for c in completions)
        out[name] = total
    assert_within(out["packed"], out["padded"], rounding_error(out["padded"], out["float64"], 50), "divergence")


def test_a_4bit_teacher_is_held_4bit_and_teaches(d):
    from kiln.models.common.quant4 import is_4bit

    rows, run = fit(on_policy_toml(d, "nf4", 'teacher_quantize = "nf4"', steps=6))
    assert any(is_4bit(m) for m in run.teacher.modules())
    full, _ = fit(run_toml(d, "nf4-full", d / "teacher", 6))
    first, full_first = rows[0]["loss"], full[0]["loss"]
    assert first != full_first  # control: the 4-bit teacher's distributions are not the full one's
    assert rows[-1]["loss"] < first, [r["loss"] for r in rows]


def test_bad_settings_are_refused_by_message(d):
    with pytest.raises(ConfigError, match="distill.lmbda must be a finite number >= 0 and <= 1, got 1.5"):
        load_run_config(on_policy_toml(d, "bad", "lmbda = 1.5"))
    with pytest.raises(ConfigError, match="distill.max_new_tokens must be >= 1, got 0"):
        load_run_config(_replaced(on_policy_toml(d, "bad", "lmbda = 1.0"), "max_new_tokens = 8",
                                  "max_new_tokens = 0"))
    with pytest.raises(ConfigError, match="teacher_quantize"):
        load_run_config(on_policy_toml(d, "bad", 'teacher_quantize = "int3"'))
    with pytest.raises(ConfigError, match="not with parallel.fsdp"):
        build_trainer(load_run_config(on_policy_toml(d, "bad", "lmbda = 0.5\n[parallel]\nfsdp = true")))


def _replaced(path: Path, old: str, new: str) -> Path:
    path.write_text(path.read_text().replace(old, new))
    return path
