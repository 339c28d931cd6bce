"""Multi-turn GRPO ([grpo] env) under FSDP2: two gloo processes, the whole model gathered once per rollout and
each rank's episodes run turn by turn on it (ranks' episodes end after different numbers of turns, with no
collective between turns). The run equals the same run under DDP on two processes (each micro-batch's episodes
seeded by its place in the global batch, so both sample the same episodes on the same weights; the trainer's
log-probs are the engine's bits, logprob_gap 0) and, SIGKILLed mid-rollout and resumed, the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.train.metrics import read_metrics
from tests.parallel.sft_runs import launch, weights
from tests.train.agent_helpers import agent_toml, make_model, make_tokenizer, write_agent_data

STEPS = 5


def _eos_prone_model(d: Path) -> Path:
    """The tiny Qwen3 of the agent tests with its end-of-turn token likely (about a third of each draw), saved:
    a random model otherwise writes every turn to its budget and no episode gets past its first turn. One
    residual dimension is a constant in every token's embedding, and only EOS's head row reads it."""
    import shutil

    tok = make_tokenizer(d)
    model = make_model(tok)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 30.0
        head[:, 0] = 0.0
        head[2, 0] = 1.0
    model.save_pretrained(d / "model")
    shutil.copytree(tok, d / "model", dirs_exist_ok=True)
    return d / "model"


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("agentfsdp")
    _eos_prone_model(d)
    return write_agent_data(d)


def _toml(d: Path, name: str, fsdp: bool, steps: int = STEPS) -> Path:
    # 2 tokens a turn: about a third of turns cut by the budget, so episodes end after 1, 2 or 3 turns
    grpo = ('env = "tests.train.agent_helpers:GuessEnv"\nrewards = ["agentrewards:short"]\nnum_iterations = 2\n'
            'temperature = 1.0\nexact_logprobs = true\nlog_rollouts_every = 1'
            + ("\n[parallel]\nfsdp = true" if fsdp else ""))
    return agent_toml(d, name, grpo, steps, model='path = "model"\ntask = "causal-lm"',
                      train="save_every = 1\nkeep_last = 10", max_new_tokens=2)


KEYS = ("loss", "reward", "reward/env", "completion_length", "logprob_gap", "alarm/turn_limit")


def _curve(run: Path) -> dict[str, list[float]]:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    return {k: [r.get(k) for r in rows] for k in KEYS}


@pytest.mark.slow  # three two-process `kiln launch` runs and one single-process run: minutes on two loaded cores
def test_fsdp2_episodes_equal_ddp_and_one_process_and_resume_exactly(agent_dir, tmp_path):
    from tests.kiln_cli import kiln

    fsdp = launch(_toml(agent_dir, "fsdp", fsdp=True))
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "(FSDP)" in fsdp.stdout and "rollouts on the generation engine under FSDP2" in fsdp.stdout
    ddp = launch(_toml(agent_dir, "ddp", fsdp=False))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = _toml(agent_dir, "one", fsdp=False)
    one.write_text(one.read_text().replace("batch_size = 2", "batch_size = 2\ngrad_accum = 2"))
    kiln("train", "--config", str(one))
    runs = {name: _curve(agent_dir / name) for name in ("fsdp", "ddp", "one")}
    for name, c in runs.items():
        assert len(c["loss"]) == STEPS, name
        assert all(torch.isfinite(torch.tensor(c["loss"]))), name
        assert c["logprob_gap"] == [0.0, None] * 2 + [0.0], name  # logged at each rollout's first update
        assert all(0.0 <= r <= 1.0 for r in c["reward/env"]), name
    assert runs["fsdp"]["loss"][0] != runs["fsdp"]["loss"][-1]  # it trains: a curve, not a constant
    episodes = [json.loads(x) for x in (agent_dir / "fsdp" / "rollouts.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 * 2 * 2 * 2  # 3 rollouts x 2 ranks x 2 prompts x 2 generations
    assert len({e["turns"] for e in episodes}) > 1 and max(e["turns"] for e in episodes) >= 2  # multi-turn, uneven
    for other in ("ddp", "one"):
        for k in KEYS:
            if k == "logprob_gap":
                continue  # [0.0, None, ...] on each, checked above
            # the same episodes (seeded by their place in the global batch, on the same weights); the
            # gradients' fp32 sums in another order (a reduce-scatter, DDP's all-reduce, one process's two
            # micro-batches), ~1e-7 relative a step, grown by AdamW over 5 steps: the tolerance of
            # tests/train/test_grpo_engine_fsdp.py and test_grpo_recipe.py's DDP test
            torch.testing.assert_close(torch.tensor(runs["fsdp"][k]), torch.tensor(runs[other][k]), rtol=1e-5,
                                       atol=1e-6, msg=f"{k} against {other}")
    # SIGKILLed after step 4 (newest checkpoint 3: the first of rollout 2's two updates), resumed: step 4 on the
    # saved episodes, step 5's sampled as the uninterrupted run sampled them
    killed = _toml(agent_dir, "killed", fsdp=True)
    p = launch(killed, env={"KILN_FAULT": "step:4"})
    assert p.returncode != 0
    assert (agent_dir / "killed" / "ckpt-000003").is_dir() and not (agent_dir / "killed" / "ckpt-000004").exists()
    resumed = launch(killed, "--resume", str(agent_dir / "killed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _curve(agent_dir / "killed") == runs["fsdp"]
    for step in (4, 5):
        a = weights(agent_dir / "fsdp" / f"ckpt-{step:06d}", tmp_path)
        b = weights(agent_dir / "killed" / f"ckpt-{step:06d}", tmp_path)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"
