"""OpenEnv 0.10's harness sessions through kiln's episodes (kiln.train.openenv_envs.OpenEnvSession): a
ResourceSession written here (a calculator task: tools add / mul, verify rewarding the right answer) opens the
conversation, gives the tools, answers each call as a tool message and is verified once, its reward the episode's;
raises end the episode with their message and the session is closed however it ended; OpenEnv's own
StepEnvSessionAdapter over a Gym-style environment plays the same episode as OpenEnvGym; a [grpo] run trains."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("openenv")

from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import (
    ResourceSession,
    ResourceSessionFactory,
    StepEnvSessionAdapter,
    ToolResult,
    VerifyResult,
)

from kiln.errors import ConfigError
from kiln.train.openenv_envs import OpenEnvGym, OpenEnvSession
from tests.train.test_agent_openenv import Guess, GuessAction, grpo_run
from tests.train.test_agent_rollout import CALL, ROW, _g, _runner, _scripted, model, tok  # noqa: F401

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "required": ["a", "b"]}


class CalcSession(ResourceSession):
    """Tools add / mul; verify: 1.0 when the last assistant message is the row's answer, else 0.0 (None when the
    row has no answer: unscored). `fail` names a method that raises."""

    def __init__(self, task: dict[str, Any], fail: str = "", tools: Any = None):
        self.task, self.fail, self.tools = task, fail, tools
        self.closed, self.verified = 0, []

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": self.task["prompt"]}]

    def list_tools(self) -> list[Tool]:
        if self.tools is not None:
            return self.tools
        return [Tool(name="add", description="a + b", input_schema=_SCHEMA),
                Tool(name="mul", description="a * b", input_schema=_SCHEMA)]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self.fail == "call_tool":
            raise RuntimeError("sandbox lost")
        if name not in ("add", "mul"):
            raise KeyError(f"Unknown tool: {name}")
        a, b = arguments["a"], arguments["b"]
        if a < 0 or b < 0:  # the session's own error result (ToolResult.error), answered to the policy
            return ToolResult(error="negative input")
        return ToolResult(data=a + b if name == "add" else a * b)

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        self.verified.append(list(transcript))
        if self.fail == "verify":
            raise RuntimeError("grader down")
        if "answer" not in self.task:
            return VerifyResult(env_reward=None)
        last = next(m for m in reversed(transcript) if m["role"] == "assistant")
        return VerifyResult(env_reward=1.0 if last.get("content", "").strip() == self.task["answer"] else 0.0,
                            done=True)

    def close(self) -> None:
        self.closed += 1


class CalcFactory(ResourceSessionFactory[CalcSession]):
    def __init__(self, **kw: Any):
        self.kw, self.made = kw, []

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> CalcSession:
        self.made.append(CalcSession(task, **self.kw))
        return self.made[-1]


def _call(name: str, a: int, b: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}


def test_a_session_by_hand_opens_answers_calls_and_is_verified_once():
    factory = CalcFactory()
    env = OpenEnvSession(factory)
    out = env.reset({"prompt": "(3 + 4) * 2?", "answer": "14"}, 5)
    (s,) = factory.made
    assert out["messages"] == s.initial_messages()
    assert [t["function"]["name"] for t in out["tools"]] == ["add", "mul"]
    assert out["tools"][0] == {"type": "function", "function": {"name": "add", "description": "a + b",
                                                                "parameters": _SCHEMA}}
    turn1 = {"role": "assistant", "content": "", "tool_calls": [_call("add", 3, 4)]}
    assert env.step(turn1) == {"messages": [{"role": "tool", "name": "add", "content": "7"}]}
    turn2 = {"role": "assistant", "content": "", "tool_calls": [_call("mul", 7, 2), _call("nope", 1, 1),
                                                                  _call("add", -1, 1)]}
    out = env.step(turn2)
    assert out["messages"] == [{"role": "tool", "name": "mul", "content": "14"},
                               {"role": "tool", "name": "nope", "content": "error: Unknown tool: nope"},
                               {"role": "tool", "name": "add", "content": "error: negative input"}]
    assert not s.verified
    out = env.step({"role": "assistant", "content": "14"})
    assert out == {"messages": [], "done": True, "reward": 1.0}
    assert len(s.verified) == 1 and [m["role"] for m in s.verified[0]] == \
        ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "tool", "assistant"]
    assert env.final_reward() is None and len(s.verified) == 1  # verified once: the reward not counted twice
    env.close()
    env.close()
    assert s.closed == 1


def test_a_wrong_answer_scores_zero_and_an_unscored_one_stays_none():
    env = OpenEnvSession(CalcFactory())
    env.reset({"prompt": "3 + 4?", "answer": "7"}, 0)
    assert env.step({"role": "assistant", "content": "8"})["reward"] == 0.0
    env = OpenEnvSession(CalcFactory())
    env.reset({"prompt": "3 + 4?"}, 0)
    assert env.step({"role": "assistant", "content": "7"}) == {"messages": [], "done": True, "reward": None}


def test_a_session_runs_as_an_episode(model, monkeypatch):
    factory = CalcFactory()
    runner, d = _runner(model, lambda: OpenEnvSession(factory))
    _scripted(monkeypatch, d, [CALL, "7"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.error is None and e.end == "done" and e.turns == 2, (e.end, e.error)
    assert [m["role"] for m in e.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert e.messages[3] == {"role": "tool", "name": "add", "content": "7"}
    assert '"name": "mul"' in d.tokenizer.decode(e.prompt_ids, skip_special_tokens=False)  # rendered with the tools
    assert e.rewards == [None, None, 1.0, None] and e.reward == 1.0  # the last None: final_reward, already verified
    assert len(factory.made) == 1 and factory.made[0].closed == 1 and len(factory.made[0].verified) == 1


def test_an_episode_kiln_ends_is_still_verified(model, monkeypatch):
    """The turn limit ends the episode after a tool call: verify is asked at the end, its reward the episode's."""
    factory = CalcFactory()
    runner, d = _runner(model, lambda: OpenEnvSession(factory), g=_g(max_turns=1))
    _scripted(monkeypatch, d, [CALL])
    (e,) = runner.run(None, [{**ROW, "answer": "x"}], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.error is None and e.end == "max_turns", (e.end, e.error)
    assert e.reward == 0.0 and len(factory.made[0].verified) == 1 and factory.made[0].closed == 1


@pytest.mark.parametrize("fail,turns,what", [("call_tool", [CALL], "env.step raised RuntimeError: sandbox lost"),
                                             ("verify", ["7"], "env.step raised RuntimeError: grader down")])
def test_a_raising_session_ends_the_episode_with_its_message_and_is_closed(model, monkeypatch, fail, turns, what):
    factory = CalcFactory(fail=fail)
    runner, d = _runner(model, lambda: OpenEnvSession(factory))
    _scripted(monkeypatch, d, turns)
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.end == "error" and e.error == what and e.reward is None, (e.end, e.error)
    assert factory.made[0].closed == 1


def test_malformed_tools_end_the_episode_naming_the_tool(model, monkeypatch):
    factory = CalcFactory(tools=[Tool(name="add", description="", input_schema=_SCHEMA), {"nom": "mul"}])
    runner, d = _runner(model, lambda: OpenEnvSession(factory))
    _scripted(monkeypatch, d, ["7"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.end == "error" and "session.list_tools()[1] is not an MCP Tool" in e.error, e.error
    assert factory.made[0].closed == 1


def test_a_factory_without_create_is_refused():
    with pytest.raises(ConfigError, match="has no create"):
        OpenEnvSession(object())


class GuessSessions(ResourceSessionFactory[StepEnvSessionAdapter]):
    """OpenEnv's own StepEnvSessionAdapter over the Gym-style Guess: one tool, `guess`, each call an Action."""

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> StepEnvSessionAdapter:
        spec = Tool(name="guess", description="Guess the digit.",
                    input_schema={"type": "object", "properties": {"guess": {"type": "string"}}})
        return StepEnvSessionAdapter(
            Guess(), task=task, seed=seed, tool_specs=[spec],
            action_builder=lambda name, args: GuessAction(guess=args["guess"]),
            initial_messages_builder=lambda obs, task: [{"role": "user", "content": f"{task['prompt']}\n\n"
                                                                                    f"{obs.feedback}"}],
            tool_result_builder=lambda name, args, obs, state: ToolResult(data=obs.feedback, done=obs.done))


def test_a_gym_environment_as_a_session_plays_the_same_episode_as_openenv_gym():
    gym, sess = OpenEnvGym(Guess(), GuessAction), OpenEnvSession(GuessSessions())
    row = {"prompt": "guess my number"}
    assert gym.reset(row, 3)["messages"] == sess.reset(row, 3)["messages"]
    gym_seen, sess_seen = [], []
    for guess in ("3", "9", "7"):
        g = gym.step({"role": "assistant", "content": guess})
        s = sess.step({"role": "assistant", "content": "",
                       "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"guess": guess}}}]})
        gym_seen.append(([m["content"] for m in g["messages"]], g["done"], g["reward"]))
        sess_seen.append(([m["content"] for m in s["messages"] if m["content"]], s.get("done", False),
                          s.get("reward") or 0.0))
    assert gym_seen == sess_seen == [(["higher"], False, 0.0), (["lower"], False, 0.0), ([], True, 1.0)]
    sess.close()


def test_an_openenv_session_trains_in_a_grpo_run(tmp_path):
    metrics = grpo_run(tmp_path, [{"prompt": f"{n} + 2?", "answer": str(n + 2)} for n in range(4)],
                       "from tests.train.test_agent_openenv_session import CalcFactory\n"
                       "from kiln.train.openenv_envs import OpenEnvSession\n"
                       "def make():\n    return OpenEnvSession(CalcFactory())\n")
    rows = [r for r in metrics if "reward" in r]
    assert len(rows) == 2 and all(r["alarm/env_errors"] == 0.0 for r in rows), rows
    # every episode scored by verify (0 or 1): the mean is a number in [0, 1], never NaN
    assert all(0.0 <= r["reward/env"] <= 1.0 for r in rows), rows
    losses = [r["loss"] for r in metrics if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(x)) for x in losses), losses
