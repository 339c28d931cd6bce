"""Environments and tools for multi-turn GRPO ([grpo] env / tools): kiln's protocol, TRL's `environment_factory`
classes adapted unchanged, and user code run under a timeout.

kiln's protocol (no kiln import needed): an object with
- `reset(row, seed) -> Obs`: the episode's opening conversation (`messages`; none: the row's prompt) and its
  `tools`; `row` is the prompts file's row (every column), `seed` an int derived from the run's seed;
- `step(assistant_message) -> Obs`: what follows the policy's turn (`messages`: tool and/or user messages),
  `done`, a per-step `reward` (None: none), `info`;
- optionally `final_reward() -> float | None`: asked once the episode is over, however it ended (but by an error),
  its reward added to the episode's;
- optionally `close()`. Any of them may be `async def`.
An `Obs` or a plain dict with those keys is accepted wherever an Obs is. A tool is an HF JSON schema (a dict; the
environment answers its calls in `step`) or a typed Python function with a docstring (kiln derives its schema with
transformers' `get_json_schema` and calls it itself, its result becoming a `tool` message).

A TRL environment class (`reset(**row)` returning None or text appended to the last user message, its public
methods the tools, optional `get_reward()`) is recognised by having `reset` and no `step`, and runs through
`TRLEnvironment`: the episode ends on a turn without tool calls; its reward is `get_reward()` once it is over.

Everything user-written runs in a daemon thread with a timeout: a raise, a hang or a malformed observation becomes
an `EpisodeError` naming the call, which ends that episode (kiln.train.agent_rollout), never the run. The worker
is kiln.train.usercode's, which also runs users' reward functions and abandons a call still running shortly after
the run is told to stop (SIGTERM / SIGINT).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.train.usercode import Abandoned, UserCodeError, UserTimeout, call_user  # noqa: F401  (re-exported)

OBS_KEYS = ("messages", "tools", "done", "reward", "info")
ROLES = ("system", "user", "assistant", "tool")


# A failed call into user code (raised, hung, malformed) ends that episode (kiln.train.agent_rollout).
EpisodeError = UserCodeError


@dataclass
class Obs:
    """What an environment returns from reset and step."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[Any] | None = None
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


async def _awaited(x: Any) -> Any:
    return await x


def as_obs(x: Any, what: str) -> Obs:
    """An Obs from what an environment returned (an Obs or a dict with Obs's keys), checked."""
    if isinstance(x, Obs):
        data = {k: getattr(x, k) for k in OBS_KEYS}
    elif isinstance(x, dict):
        unknown = sorted(set(x) - set(OBS_KEYS))
        if unknown:
            raise EpisodeError(f"{what} returned a dict with unknown keys {unknown} (an observation has "
                               f"{', '.join(OBS_KEYS)})")
        data = dict(x)
    else:
        raise EpisodeError(f"{what} returned {type(x).__name__}, not an Obs or a dict with keys {', '.join(OBS_KEYS)}")
    messages = data.get("messages") or []
    if not isinstance(messages, list):
        raise EpisodeError(f"{what}: messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content", ""), str)):
            raise EpisodeError(f"{what}: messages[{i}] is not a {{role, content}} message with a role in "
                               f"{ROLES} and string content: {str(m)[:120]}")
    reward = data.get("reward")
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EpisodeError(f"{what}: reward {reward!r} is not a number") from None
        if not math.isfinite(reward):
            raise EpisodeError(f"{what}: reward is {reward}")
    info = data.get("info") or {}
    if not isinstance(info, dict):
        raise EpisodeError(f"{what}: info must be a dict, got {type(info).__name__}")
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise EpisodeError(f"{what}: tools must be a list of JSON schemas or functions, got {type(tools).__name__}")
    return Obs(list(messages), tools, bool(data.get("done", False)), reward, info)


# ---- tools -----------------------------------------------------------------------------------------
@dataclass
class Tool:
    name: str
    schema: dict[str, Any]              # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., Any] | None       # None: a schema the environment answers itself


def as_tool(x: Any, what: str) -> Tool:
    """A Tool from an HF JSON schema or a typed, documented Python function."""
    if isinstance(x, dict):
        fn_part = x.get("function", x)
        if not (isinstance(fn_part, dict) and isinstance(fn_part.get("name"), str)):
            raise ConfigError(f"{what}: a tool schema needs function.name (the HF / OpenAI JSON schema), got "
                            f"{json.dumps(x)[:120]}")
        schema = x if "function" in x else {"type": "function", "function": x}
        return Tool(fn_part["name"], schema, None)
    if callable(x):
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(x)
        except Exception as e:  # noqa: BLE001 - transformers names the missing docstring or type hint
            raise ConfigError(f"{what}: {getattr(x, '__name__', x)!r} cannot be a tool: {e}") from None
        return Tool(schema["function"]["name"], schema, x)
    raise ConfigError(f"{what}: a tool is a JSON schema (dict) or a function, got {type(x).__name__}")


def tool_message(tools: dict[str, Tool], call: dict[str, Any], timeout: float) -> tuple[dict[str, Any], bool]:
    """Run one parsed tool call: (the `tool` message with its result, whether it failed). A failure (unknown
    tool, bad arguments, a raise, a hang) is the message's content, as TRL's {"error": ...}: the policy sees it."""
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    name, args = fn.get("name"), fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None or tool.fn is None:
        return {"role": "tool", "name": str(name), "content": json.dumps({"error": f"no tool {name!r}"})}, True
    if not isinstance(args, dict):
        return {"role": "tool", "name": name, "content": json.dumps({"error": "arguments must be an object"})}, True
    try:
        result = call_user(tool.fn, timeout=timeout, what=f"tool {name!r}", **args)
    except EpisodeError as e:
        return {"role": "tool", "name": name, "content": json.dumps({"error": str(e)})}, True
    content = result if isinstance(result, str) else json.dumps(result, default=str)
    return {"role": "tool", "name": name, "content": content}, False


# ---- adapters ----------------------------------------------------------------------------------------
class TRLEnvironment:
    """A TRL 1.16 `environment_factory` instance under kiln's protocol: reset(**row) (its text appended to the
    prompt's last user message), its public methods as tools (called by kiln), done on a turn without tool calls,
    and `get_reward()` (when it has one) as the episode's reward once it is over (`final_reward`)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def methods(self) -> list[Callable[..., Any]]:
        cls = type(self.inner)  # members of the class: getmembers on the instance would evaluate properties
        return [getattr(self.inner, n) for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                if n not in ("reset", "get_reward") and not n.startswith("_")]

    def reset(self, row: dict[str, Any], seed: int) -> Any:
        text = self.inner.reset(**row)
        if inspect.isawaitable(text):
            text = asyncio.run(_awaited(text))
        prompt = row.get("prompt")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt or []]
        if text is not None:
            if not isinstance(text, str):
                raise EpisodeError(f"{type(self.inner).__name__}.reset returned {type(text).__name__}, not None or "
                                   "a string")
            if not messages or messages[-1]["role"] != "user":
                messages.append({"role": "user", "content": ""})
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
        return Obs(messages, list(self.methods()))

    def step(self, message: dict[str, Any]) -> Any:
        # kiln ran the tool calls (the methods are function tools); a turn without any ends the episode
        return Obs(done=not message.get("tool_calls"))

    def final_reward(self) -> float | None:
        """get_reward() once the episode is over, however it ended (TRL scores every rollout so)."""
        if not callable(getattr(self.inner, "get_reward", None)):
            return None
        reward = self.inner.get_reward()
        return asyncio.run(_awaited(reward)) if inspect.isawaitable(reward) else reward


class ToolsOnly:
    """No environment, only tools: the row's prompt opens the episode; it ends on a turn without tool calls."""

    def __init__(self, tools: list[Any]):
        self.tools = tools

    def reset(self, row: dict[str, Any], seed: int) -> Obs:
        prompt = row.get("prompt")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt or []]
        return Obs(messages, list(self.tools))

    def step(self, message: dict[str, Any]) -> Obs:
        return Obs(done=not message.get("tool_calls"))


def adapt(instance: Any, what: str) -> Any:
    """An environment object under kiln's protocol: kiln's own (reset and step) as is, TRL's (reset, no step)
    through TRLEnvironment; anything else refused naming what it lacks."""
    has_reset = callable(getattr(instance, "reset", None))
    if has_reset and callable(getattr(instance, "step", None)):
        return instance
    if has_reset:
        return TRLEnvironment(instance)
    raise ConfigError(f"{what} made a {type(instance).__name__}, which has no reset(): an environment has "
                      "reset(row, seed) and step(message) (kiln's protocol), or reset(**row) and tool methods (TRL's)")


@dataclass
class EnvSpec:
    """What [grpo] env / tools resolve to: a factory per episode and the stateless tools."""
    factory: Callable[[], Any] | None
    tools: list[Tool]
    timeout: float

    def make(self) -> Any:
        if self.factory is None:
            return ToolsOnly([t.fn for t in self.tools])
        return adapt(call_user(self.factory, timeout=self.timeout, what="grpo.env factory"), "grpo.env")


def resolve_env(env: str | None, tools: Sequence[str], search: Sequence[Path], timeout: float) -> EnvSpec | None:
    """grpo.env ("module:factory") and grpo.tools (["module:function"]) imported (beside data.train, then on
    sys.path) and checked before any model work; None when neither is set."""
    from kiln.train.rewards import import_attr

    if env is None and not tools:
        return None
    factory = import_attr(env, search, "grpo.env") if env is not None else None
    if factory is not None and not callable(factory):
        raise ConfigError(f"grpo.env: {env} is not callable (a class or a function returning an environment)")
    resolved = [as_tool(import_attr(t, search, "grpo.tools"), f"grpo.tools {t}") for t in tools]
    names = [t.name for t in resolved]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"grpo.tools names {dup!r} twice")
    return EnvSpec(factory, resolved, timeout)
