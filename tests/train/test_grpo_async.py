"""[grpo] async = true (kiln.train.grpo_async): the schedule keeps every rollout within max_staleness steps (and
its weights really are the older ones), the IS correction and the mismatch metrics equal a hand computation from
two checkpoints' forwards, max_staleness = 0 is the synchronous run bit for bit, a run SIGKILLed and resumed ends
where one never stopped, and async = false is the plain engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.errors import ConfigError
from kiln.train import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.kiln_cli import kiln
from tests.train.test_agent_grpo import agent_dir  # noqa: F401  (fixtures, used by name)
from tests.train.test_grpo_recipe import _toml, grpo_dir  # noqa: F401

ASYNC = "async = true\nimportance_sampling_correction = true\n"


def _run(d: Path, name: str, grpo: str, steps: int, train: str = "") -> tuple[object, list[dict]]:
    trainer = build_trainer(load_run_config(_toml(d, name, grpo=grpo, train=train, steps=steps)))
    trainer.fit()
    return trainer, [r for r in read_metrics(d / name / "metrics.jsonl") if "reward" in r]


def _curve(rows: list[dict], drop: tuple[str, ...] = ()) -> list:
    return [sorted((k, v) for k, v in r.items() if not k.endswith("_per_s") and k not in drop) for r in rows]


@pytest.mark.parametrize("k, s", [(1, 1), (2, 2), (1, 3)])
def test_staleness_follows_the_schedule_and_never_exceeds_the_bound(grpo_dir, k, s):
    """Rollout r (first trained at step r*k) is sampled at step max(0, r*k - s): its staleness min(r*k, s), never
    over s. With exact_logprobs the sampler's and the trainer's kernels agree bit for bit, so the mismatch is the
    staleness alone: exactly 0 for rollouts from the current weights, > 0 for older ones (the worker's weights
    are a snapshot, not the live ones)."""
    trainer, rows = _run(grpo_dir, f"stale-{k}-{s}", ASYNC + f"num_iterations = {k}\nmax_staleness = {s}\n"
                         "exact_logprobs = true", steps=6)
    assert len(rows) == 6
    for t, r in enumerate(rows):
        first = (t // k) * k
        assert r["staleness"] == min(first, s) <= s, (t, r["staleness"])
        if r["staleness"] == 0:
            assert r["mismatch/kl"] == 0.0 and r["mismatch/max_ratio"] == 1.0, (t, r)
        else:
            assert r["mismatch/kl"] > 0.0, (t, r)
    launched = trainer.engine.launched
    assert [i for i, _ in launched] == list(range(len(launched)))  # each rollout once, in order
    assert all(v == max(0, i * k - s) for i, v in launched), launched


def _hand_logps(model: torch.nn.Module, micro: dict) -> list[list[float]]:
    """Each row's completion log-probs from a plain forward of its unpadded tokens (temperature 1)."""
    p, out = micro["prompt_len"], []
    for i in range(micro["input_ids"].size(0)):
        ids = micro["input_ids"][i][micro["attention_mask"][i].bool()]
        start = int(micro["attention_mask"][i, :p].sum())
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()
        lp = logits.log_softmax(-1)
        out.append([float(lp[start - 1 + j, ids[start + j]]) for j in range(ids.numel() - start)])
    return out


@pytest.mark.parametrize("mode, lo, hi", [("token_truncate", None, 1.02), ("sequence_mask", 0.9, 1.1)])
def test_is_correction_equals_a_hand_computation_from_two_checkpoints(grpo_dir, mode, lo, hi):
    """max_staleness 1: the last rollout (step 3's) was sampled from step 2's weights and trained from step 3's.
    Forwards of the two checkpoints give the sampler's and the old log-probs (fp32 through other summation
    orders: within 1e-4); the IS ratio by hand (math.exp, clamped or masked to the clip bounds) equals the one
    the loss used, and mismatch/kl and max_ratio equal theirs by hand."""
    from kiln.models.auto import AutoConfig, from_config

    bounds = "".join(f"importance_sampling_clip_{n} = {v}\n" for n, v in (("min", lo), ("max", hi)) if v is not None)
    if hi is None:
        bounds += "importance_sampling_clip_max = 1e9\n"
    name = f"is-{mode}"
    trainer, rows = _run(grpo_dir, name, ASYNC + f'importance_sampling_mode = "{mode}"\n' + bounds, steps=4,
                         train="save_every = 1\nkeep_last = 10")
    assert rows[-1]["staleness"] == 1
    cfg = load_run_config(grpo_dir / f"{name}.toml").model.config
    models = {}
    for step in (2, 3):
        m = from_config(AutoConfig.for_model("qwen3", **cfg), task="causal-lm")
        m.load_state_dict(load_file(str(grpo_dir / name / f"ckpt-{step:06d}" / "model" / "model.safetensors")))
        models[step] = m.eval()
    k3, tokens, top, clipped = 0.0, 0, 0.0, 0
    for micro in trainer.engine.buffer:
        mask = micro["loss_mask"].tolist()
        sampler, old = micro["sampler_logps"].tolist(), micro["old_logps"].tolist()
        for i, (by2, by3) in enumerate(zip(_hand_logps(models[2], micro), _hand_logps(models[3], micro))):
            n = int(micro["completion_mask"][i].sum())
            assert max(abs(a - b) for a, b in zip(by2, sampler[i][:n])) < 1e-4
            assert max(abs(a - b) for a, b in zip(by3, old[i][:n])) < 1e-4
            diffs = [(old[i][j] - sampler[i][j]) * mask[i][j] for j in range(len(mask[i]))]
            for j, d in enumerate(diffs):
                if mask[i][j]:
                    w = math.exp(d)
                    k3, tokens, top = k3 + (w - 1 - d), tokens + 1, max(top, w)
            got = micro["is_ratio"][i].tolist()
            if mode == "token_truncate":
                want = [min(math.exp(d), hi) for d in diffs]
                clipped += sum(math.exp(d) > hi for d in diffs)
            else:
                w = math.exp(sum(diffs))
                want = [w if lo <= w <= hi else 0.0]
                clipped += not lo <= w <= hi
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (i, got, want)
    assert clipped > 0  # the bounds bite somewhere: a correction that ignored them would fail above
    assert rows[-1]["mismatch/kl"] == pytest.approx(k3 / tokens, rel=1e-4)
    assert rows[-1]["mismatch/max_ratio"] == pytest.approx(top, rel=1e-6)


def test_no_staleness_is_the_synchronous_run(grpo_dir):
    """max_staleness = 0: each rollout sampled (by the worker) from the weights that train on it, the same rows
    and seeds: the run equals a synchronous one with the same loss (the trainer's old log-probs, IS on), metric
    for metric and weight for weight. A control: max_staleness = 1 differs."""
    same = 'exact_logprobs = true\nsampler = "exact"\nimportance_sampling_correction = true\n'
    _, sync = _run(grpo_dir, "sync0", same, steps=3)
    _, async0 = _run(grpo_dir, "async0", same + "async = true\nmax_staleness = 0", steps=3)
    _, async1 = _run(grpo_dir, "async1", same + "async = true\nmax_staleness = 1", steps=3)
    extra = ("staleness", "mismatch/kl", "mismatch/max_ratio")
    # pad_fraction (the prompt batches' padding) is not logged by async runs: their rows are drawn a step ahead
    assert _curve(async0, extra) == _curve(sync, ("pad_fraction",))
    a = load_file(str(grpo_dir / "sync0" / "ckpt-000003" / "model" / "model.safetensors"))
    b = load_file(str(grpo_dir / "async0" / "ckpt-000003" / "model" / "model.safetensors"))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert _curve(async1, extra) != _curve(sync, ("pad_fraction",))


def test_async_false_is_the_plain_engine_and_bad_settings_are_named(grpo_dir):
    from kiln.train.grpo_async import AsyncGRPOEngine
    from kiln.train.recipes.grpo import GRPOEngine

    trainer, _ = _run(grpo_dir, "plain", "", steps=1)
    assert type(trainer.engine) is GRPOEngine and not isinstance(trainer.engine, AsyncGRPOEngine)
    assert load_run_config(_toml(grpo_dir, "d")).grpo.async_ is False
    with pytest.raises(ConfigError, match="grpo.async = true trains on rollouts .*importance_sampling_correction = true"):
        load_run_config(_toml(grpo_dir, "bad-async", grpo="async = true"))
    with pytest.raises(ConfigError, match="grpo.max_staleness must be >= 0"):
        load_run_config(_toml(grpo_dir, "bad-stale", grpo=ASYNC + "max_staleness = -1"))


@pytest.mark.slow
@pytest.mark.parametrize("env", [False, True], ids=["single-turn", "episodes"])
def test_an_async_run_sigkilled_then_resumed_is_exact(request, env):
    """max_staleness 2: killed after step 4 (newest checkpoint 3), two launched rollouts were sampled from older
    weights (saved whole) and one was in flight at step 3's (regenerated from its seeds on resume). Weights,
    metrics and rollouts.jsonl equal an uninterrupted run's. With an environment the saved rollouts hold
    episodes (tests.train.test_agent_grpo's tiny tool-template model and GuessEnv)."""
    grpo = ASYNC + "max_staleness = 2\nlog_rollouts_every = 1\n"
    if env:
        from tests.train.test_agent_grpo import _toml as agent_toml

        d = request.getfixturevalue("agent_dir")
        grpo += 'env = "tests.train.agent_helpers:GuessEnv"\nrewards = ["agentrewards:short"]'
        make = lambda name: agent_toml(d, name, grpo, steps=6)  # noqa: E731
    else:
        d = request.getfixturevalue("grpo_dir")
        make = lambda name: _toml(d, name, grpo=grpo, steps=6)  # noqa: E731
    tag = "env" if env else "plain"
    names = (f"a-ref-{tag}", f"a-killed-{tag}")
    for name in names:
        cfg = make(name)
        cfg.write_text(cfg.read_text().replace("progress = false", "progress = false\nsave_every = 1\nkeep_last = 10"))
    kiln("train", "--config", str(d / f"{names[0]}.toml"))
    p = kiln("train", "--config", str(d / f"{names[1]}.toml"), env={"KILN_FAULT": "step:4"}, check=False)
    assert p.returncode == -9, p.stderr
    killed = d / names[1]
    assert (killed / "ckpt-000003").is_dir() and not (killed / "ckpt-000004").exists()
    state = json.loads((killed / "ckpt-000003" / "trainer.json").read_text())
    jobs = state["engine"]["async"][0]["jobs"]
    assert [(j["index"], j["version"], j.get("sampled") is not None) for j in jobs] == \
        [(3, 1, True), (4, 2, True), (5, 3, False)]
    kiln("train", "--config", str(d / f"{names[1]}.toml"), "--resume", str(killed))
    for step in (4, 5, 6):
        a = load_file(str(d / names[0] / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(killed / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"
    assert _curve(read_metrics(killed / "metrics.jsonl")) == _curve(read_metrics(d / names[0] / "metrics.jsonl"))
    # steps 4-6 (the killed run wrote step 4 twice); as JSON values: a rollout restored from trainer.json (written
    # with sorted keys) writes its messages' keys in another order
    ref = [json.loads(x) for x in (d / names[0] / "rollouts.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (killed / "rollouts.jsonl").read_text().splitlines()]
    assert got[-len(ref) // 2:] == ref[-len(ref) // 2:]
