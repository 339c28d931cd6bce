"""OpenEnv 0.10 environments through kiln's episodes (kiln.train.openenv_envs, the `kiln[openenv]` extra): an MCP
tool environment built from OpenEnv's own classes (a FastMCP server inside an MCPEnvironment) gives the episode
its tools and answers the policy's calls as tool messages (loss mask 0); a Gym-style Environment with its own
Action and Observation models turns the assistant message into its Action and its observations into user turns,
its reward and done passed through; both run end to end in a [grpo] run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("openenv")

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

from kiln.errors import ConfigError
from kiln.train import agent_rollout as ar
from kiln.train.openenv_envs import OpenEnvGym, OpenEnvTools
from tests.train.test_agent_rollout import CALL, EOS, ROW, _runner, _scripted, model, tok  # noqa: F401


class Calc(MCPEnvironment):
    """An MCP tool environment: `add` on a FastMCP server; each call rewarded 0.25."""

    def __init__(self) -> None:
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> Observation:
        return Observation(done=False, reward=None)

    def _step_impl(self, action: Any, timeout_s: Any = None, **kw: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    def step(self, action: Any, timeout_s: Any = None, **kw: Any) -> Observation:
        obs = super().step(action, timeout_s=timeout_s, **kw)
        if type(action).__name__ == "CallToolAction":
            obs.reward = 0.25
        return obs

    @property
    def state(self) -> State:
        return self._state


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class Guess(Environment):
    """Gym-style: guess 7; feedback "higher" / "lower"; reward 1 and done on the right guess."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State()

    def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> GuessObservation:
        return GuessObservation(feedback="Guess a digit.")

    def step(self, action: Any, timeout_s: Any = None, **kw: Any) -> GuessObservation:
        digits = "".join(c for c in action.guess if c.isdigit())
        if digits == "7":
            return GuessObservation(done=True, reward=1.0)
        return GuessObservation(feedback="higher" if not digits or int(digits) < 7 else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def test_an_mcp_tool_environment_gives_tools_and_answers_calls(model, monkeypatch):
    runner, d = _runner(model, lambda: OpenEnvTools(Calc()))
    _scripted(monkeypatch, d, [CALL, "7"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.error is None and e.end == "done" and e.turns == 2, (e.end, e.error)
    assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "assistant"]
    assert e.messages[2] == {"role": "tool", "name": "add", "content": "7"}
    assert e.schemas[0]["function"]["name"] == "add" and e.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert '"name": "add"' in d.tokenizer.decode(e.prompt_ids, skip_special_tokens=False)  # rendered with the tool
    assert e.rewards == [None, 0.25, None] and e.reward == 0.25
    turn1 = d.encode(CALL) + [EOS]
    between = d.encode("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert e.ids[: len(turn1) + len(between)] == turn1 + between
    assert e.mask[: len(turn1) + len(between)] == [1] * len(turn1) + [0] * len(between)


def test_an_unknown_tool_is_answered_with_the_environments_error():
    env = OpenEnvTools(Calc())
    env.reset({}, 0)
    out = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "nope", "arguments": "{}"}}]})
    assert out["messages"][0]["content"].startswith("error: Unknown tool") and out["done"] is False


def test_a_gym_style_environment_runs_with_its_action_and_observation_models(model, monkeypatch):
    runner, d = _runner(model, lambda: OpenEnvGym(Guess(), GuessAction))
    _scripted(monkeypatch, d, ["3", "9", "7"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.error is None and e.end == "done" and e.turns == 3, (e.end, e.error)
    assert e.messages[0] == {"role": "user", "content": "guess my number\n\nGuess a digit."}
    assert [m["content"] for m in e.messages[1:]] == ["3", "higher", "9", "lower", "7"]
    assert e.rewards == [None, 0.0, 0.0, 1.0] and e.reward == 1.0
    assert sum(e.mask) == 3 * 2  # each turn: its digit token and the end-of-turn token; the hints carry none


def test_an_action_class_without_one_text_field_is_refused():
    class Two(Action):
        a: str
        b: str

    with pytest.raises(ConfigError, match="has 2 text fields"):
        OpenEnvGym(Guess(), Two)


def grpo_run(tmp_path, prompts: list[dict[str, Any]], factory_module: str) -> list[dict[str, Any]]:
    """A tiny 2-step [grpo] run with `env` the function `make` of factory_module (the module's source) on
    `prompts`: its metrics rows."""
    import json

    from kiln.train import load_run_config
    from kiln.train.metrics import read_metrics
    from kiln.train.run import build_trainer
    from tests.train.agent_helpers import make_tokenizer
    from tests.train.test_agent_grpo import _toml

    make_tokenizer(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "oe_envs.py").write_text(factory_module)
    cfg = _toml(tmp_path, "oe", 'env = "oe_envs:make"')
    build_trainer(load_run_config(cfg)).fit()
    return read_metrics(tmp_path / "oe" / "metrics.jsonl")


def test_an_openenv_environment_trains_in_a_grpo_run(tmp_path):
    metrics = grpo_run(tmp_path, [{"prompt": f"guess {n}"} for n in range(4)],
                       "from tests.train.test_agent_openenv import Guess, GuessAction\n"
                       "from kiln.train.openenv_envs import OpenEnvGym\n"
                       "def make():\n    return OpenEnvGym(Guess(), GuessAction)\n")
    rows = [r for r in metrics if "reward" in r]
    assert len(rows) == 2 and rows[0]["alarm/env_errors"] == 0.0 and "reward/env" in rows[0]
    assert ar.ENV_COLUMN  # the env column the run scored through
