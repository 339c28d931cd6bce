"""[grpo] with an environment or tools, end to end on a tiny Qwen3: episodes train, the environment's reward is
`reward/env`, the alarms are logged every step and warned once, rollouts.jsonl holds each episode; a template
that cannot run episodes is refused before any step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.train import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.agent_helpers import agent_toml, make_tokenizer, write_agent_data


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("agentgrpo")
    make_tokenizer(d)
    return write_agent_data(d)


def _toml(d: Path, name: str, grpo: str, steps: int = 2) -> Path:
    return agent_toml(d, name, grpo, steps)


def test_an_environment_run_trains_logs_alarms_and_writes_episodes(agent_dir, capsys):
    cfg = _toml(agent_dir, "env", 'env = "tests.train.agent_helpers:GuessEnv"\nlog_rollouts_every = 1')
    build_trainer(load_run_config(cfg)).fit()
    rows = [r for r in read_metrics(agent_dir / "env" / "metrics.jsonl") if "reward" in r]
    assert len(rows) == 2
    for r in rows:
        assert {"reward/env", "alarm/truncated", "alarm/zero_std_groups", "alarm/none_rewards", "alarm/turn_limit",
                "alarm/parse_failures", "alarm/env_errors", "logprob_gap"} <= set(r), sorted(r)
        assert 0.0 <= r["alarm/truncated"] <= 1.0 and r["alarm/env_errors"] == 0.0
    # 8 tokens a turn from a random 400-token model: almost every turn is cut by the budget
    out = capsys.readouterr().out
    assert out.count("alarm/truncated") == 1, out  # warned once, not every step
    episodes = [json.loads(x) for x in (agent_dir / "env" / "rollouts.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 2  # two rollouts of 2 prompts x 2 generations
    for e in episodes:
        assert len(e["loss_mask"]) == len(e["completion_ids"]) and e["turns"] >= 1
        assert e["messages"][0] == {"role": "user", "content": e["messages"][0]["content"]}
        assert e["end"] in {"done", "no_message", "max_turns", "budget", "truncated"}
        assert set(e["rewards"]) == {"env"}


def test_tools_only_run_with_reward_functions(agent_dir):
    cfg = _toml(agent_dir, "tools", 'tools = ["tests.train.agent_helpers:adder"]\nrewards = ["agentrewards:short"]')
    build_trainer(load_run_config(cfg)).fit()
    rows = [r for r in read_metrics(agent_dir / "tools" / "metrics.jsonl") if "reward" in r]
    assert len(rows) == 2 and "reward/short" in rows[0] and "alarm/turn_limit" in rows[0]


def test_a_template_without_tools_is_refused_before_any_step(agent_dir, tmp_path):
    from kiln.hub.chat import CHATML_TEMPLATE

    tok = tmp_path / "tok"
    import shutil
    shutil.copytree(agent_dir / "tok", tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML_TEMPLATE
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    toml = _toml(agent_dir, "refused", 'env = "tests.train.agent_helpers:GuessEnv"')
    toml.write_text(toml.read_text().replace('tokenizer = "tok"', f'tokenizer = "{tok}"'))
    with pytest.raises(ConfigError, match="does not render `tools`"):
        build_trainer(load_run_config(toml))
    assert not (agent_dir / "refused" / "metrics.jsonl").exists()


@pytest.mark.parametrize("grpo, message", [
    ('env = "tests.train.agent_helpers:NoSuch"', r"grpo.env: module 'tests.train.agent_helpers' has no 'NoSuch'"),
    ('tools = ["tests.train.agent_helpers:undocumented"]\nrewards = ["agentrewards:short"]',
     r"grpo.tools tests.train.agent_helpers:undocumented: 'undocumented' cannot be a tool"),
    ('env = "tests.train.agent_helpers:GuessEnv"\nenv_timeout = 0', r"grpo.env_timeout must be > 0"),
])
def test_env_config_errors_are_named(agent_dir, grpo, message):
    with pytest.raises(ConfigError, match=message):
        build_trainer(load_run_config(_toml(agent_dir, "bad", grpo)))


@pytest.mark.slow
def test_an_environment_run_sigkilled_mid_rollout_resumes_exactly(agent_dir):
    """num_iterations = 2, killed after step 4 (newest checkpoint 3, mid rollout): the resumed run takes step 4 on
    the saved episodes and samples step 5's as the uninterrupted run did (episode seeds from the rollout's)."""
    import torch
    from safetensors.torch import load_file

    from tests.kiln_cli import kiln

    grpo = 'env = "tests.train.agent_helpers:GuessEnv"\nnum_iterations = 2'
    runs = {}
    for name in ("env-ref", "env-killed"):
        cfg = _toml(agent_dir, name, grpo, steps=6)
        cfg.write_text(cfg.read_text().replace("progress = false", "progress = false\nsave_every = 1\nkeep_last = 10"))
        runs[name] = cfg
    kiln("train", "--config", str(runs["env-ref"]))
    p = kiln("train", "--config", str(runs["env-killed"]), env={"KILN_FAULT": "step:4"}, check=False)
    assert p.returncode == -9, p.stderr
    kiln("train", "--config", str(runs["env-killed"]), "--resume", str(agent_dir / "env-killed"))
    for step in (4, 5, 6):
        a = load_file(str(agent_dir / "env-ref" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(agent_dir / "env-killed" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"

    def curve(run: Path) -> list:
        return [sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))
                for r in read_metrics(run / "metrics.jsonl")]
    assert curve(agent_dir / "env-killed") == curve(agent_dir / "env-ref")
