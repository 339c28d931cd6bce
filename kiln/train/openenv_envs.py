"""OpenEnv environments as kiln environments ([grpo] env; the optional extra `kiln[openenv]`, OpenEnv 0.10), in
process and offline: wrap an instance in a factory (`env = "mymod:make"`, `def make(): return OpenEnvTools(MyEnv())`).

- `OpenEnvGym`: a Gym-style `openenv.core.env_server.Environment` (`reset(seed=...)` and `step(Action)`
  returning Observations with `done`, `reward`). The assistant message becomes the environment's Action by
  `action` (a callable, or an Action class with one text field, which gets the message's content); each
  Observation becomes the next user message by `observe` (a callable returning text or None; by default the
  observation's one text field, or its fields other than done / reward / metadata as JSON). The reset
  observation's text follows the row's prompt in the opening user message.
- `OpenEnvTools`: an MCP tool environment (`MCPEnvironment`): its tools (from ListToolsAction) are the
  episode's tools, as JSON schemas the environment answers: each tool call of a turn is a CallToolAction, its
  result (text contents joined, else the value) a `tool` message; the episode ends on a turn without tool calls
  (TRL's rule) or an observation's `done`; the step's reward is the sum of the calls' rewards (None: none).
- `OpenEnvSession`: OpenEnv's harness sessions (`openenv.core.harness.ResourceSessionFactory`, e.g. its
  `StepEnvSessionAdapter`): each episode is one session made by `create(task=row, seed=seed)`; its
  `initial_messages()` open the conversation (none: the row's prompt), its `list_tools()` are the episode's tools;
  each tool call of a turn goes through `call_tool`, its result a `tool` message (a `KeyError` / `ValueError`, the
  session's "unknown tool" / "bad arguments", is answered to the policy as an error, as OpenEnv's MCP bridge
  does; anything else raised ends the episode). The episode ends on a turn without tool calls or a result's
  `done`, and then, or once kiln ends it (a token budget, the turn limit), `verify(transcript)` is asked once:
  its `env_reward` is the episode's reward (None stays None: unscored, as OpenEnv says). The session is closed
  however the episode ended.

kiln's episode runner calls these through its timeouts (kiln.train.envs): a raise or a hang in OpenEnv code ends
the episode with its message. OpenEnv's TRL bridge drops the tool tokens; here they are the environment's (loss
mask 0) and the policy's calls are the policy's (loss mask 1), as for any kiln environment.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kiln.errors import ConfigError
from kiln.train.envs import EpisodeError

_META = ("done", "reward", "metadata")


def _openenv() -> Any:
    try:
        from openenv.core.env_server import mcp_types, types  # type: ignore[import-untyped]
    except ImportError as e:
        raise ConfigError(f"OpenEnv environments need the openenv package (pip install 'kiln[openenv]'): {e}") \
            from None
    return types, mcp_types


def _text_fields(model_type: Any) -> list[str]:
    return [n for n, f in model_type.model_fields.items() if n not in _META and f.annotation is str]


def default_observe(obs: Any) -> str | None:
    """An Observation's own text: its one text field, else its fields beyond done / reward / metadata as JSON."""
    fields = {k: v for k, v in obs.model_dump().items() if k not in _META}
    texts = _text_fields(type(obs))
    if len(texts) == 1:
        return getattr(obs, texts[0]) or None
    return json.dumps(fields, default=str, sort_keys=True) if fields else None


class OpenEnvGym:
    """kiln's protocol over a Gym-style OpenEnv Environment (see the module docstring)."""

    def __init__(self, env: Any, action: Callable[[dict[str, Any]], Any] | type,
                 observe: Callable[[Any], str | None] = default_observe):
        types, _ = _openenv()
        if isinstance(action, type):
            if not issubclass(action, types.Action):
                raise ConfigError(f"OpenEnvGym: action {action.__name__} is not an openenv Action class")
            fields = _text_fields(action)
            if len(fields) != 1:
                raise ConfigError(f"OpenEnvGym: action class {action.__name__} has {len(fields)} text fields "
                                  f"({', '.join(fields) or 'none'}); pass a function message -> Action instead")
            cls, name = action, fields[0]
            self.action: Callable[[dict[str, Any]], Any] = lambda m: cls(**{name: m.get("content") or ""})
        else:
            self.action = action
        self.env, self.observe = env, observe

    def reset(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        obs = self.env.reset(seed=seed)
        text = self.observe(obs)
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # a conversation: the observation as one more user message
            messages = list(prompt) + ([{"role": "user", "content": text}] if text else [])
        else:
            content = "\n\n".join(t for t in (prompt, text) if t)
            messages = [{"role": "user", "content": content}] if content else []
        return {"messages": messages, "done": bool(obs.done), "reward": obs.reward}

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        obs = self.env.step(self.action(message))
        text = None if obs.done else self.observe(obs)
        return {"messages": [{"role": "user", "content": text}] if text else [], "done": bool(obs.done),
                "reward": obs.reward}

    def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            self.env.close()


def tool_result_text(result: Any) -> str:
    """An MCP call's result as a tool message's text: its text contents joined, else its value."""
    contents = getattr(result, "content", None)
    if isinstance(contents, list) and contents and all(hasattr(c, "text") for c in contents):
        return "".join(c.text for c in contents)
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, default=str)


def tool_schemas(tools: Any, what: str) -> list[dict[str, Any]]:
    """MCP Tools (name, description, input_schema) as HF JSON tool schemas; a malformed one named."""
    if not isinstance(tools, list):
        raise EpisodeError(f"{what} returned {type(tools).__name__}, not a list of MCP Tools")
    out = []
    for i, t in enumerate(tools):
        name, schema = getattr(t, "name", None), getattr(t, "input_schema", None)
        if not isinstance(name, str) or not name or not isinstance(schema, dict | None):
            raise EpisodeError(f"{what}[{i}] is not an MCP Tool with a name and a JSON-schema input_schema: "
                               f"{str(t)[:120]}")
        out.append({"type": "function", "function": {
            "name": name, "description": getattr(t, "description", None) or "",
            "parameters": schema or {"type": "object", "properties": {}}}})
    return out


def call_arguments(call: Any) -> tuple[str, dict[str, Any]]:
    """A parsed tool call's name and arguments (a JSON string decoded: OpenAI's layout; not an object: none)."""
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    name, args = fn.get("name"), fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    return str(name), args if isinstance(args, dict) else {}


class OpenEnvTools:
    """kiln's protocol over an OpenEnv MCP tool environment (see the module docstring)."""

    def __init__(self, env: Any):
        _, self.mcp = _openenv()
        self.env = env

    def reset(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        self.env.reset(seed=seed)
        listed = self.env.step(self.mcp.ListToolsAction())
        return {"tools": tool_schemas(listed.tools, "ListToolsAction tools")}

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls") or []
        if not calls:
            return {"done": True}
        messages, rewards, done = [], [], False
        for call in calls:
            name, args = call_arguments(call)
            obs = self.env.step(self.mcp.CallToolAction(tool_name=name, arguments=args))
            text = f"error: {obs.error.message}" if obs.error is not None else tool_result_text(obs.result)
            messages.append({"role": "tool", "name": name, "content": text})
            if obs.reward is not None:
                rewards.append(float(obs.reward))
            done = done or bool(obs.done)
        return {"messages": messages, "done": done, "reward": sum(rewards) if rewards else None}

    def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            self.env.close()


class OpenEnvSession:
    """kiln's protocol over an OpenEnv harness ResourceSessionFactory (see the module docstring); one instance
    per episode, as kiln makes one environment per episode from [grpo] env's factory."""

    def __init__(self, factory: Any):
        if not callable(getattr(factory, "create", None)):
            raise ConfigError(f"OpenEnvSession: {type(factory).__name__} has no create(task, seed, episode_id): "
                              "pass an openenv.core.harness ResourceSessionFactory")
        self.factory = factory
        self.session: Any = None  # a ResourceSession once reset made one; None again once closed
        self.transcript: list[dict[str, Any]] = []
        self.verified = False

    def reset(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        self.session = self.factory.create(task=row, seed=seed)
        messages = [dict(m) for m in self.session.initial_messages() or []]
        tools = tool_schemas(self.session.list_tools(), "session.list_tools()")
        prompt = row.get("prompt")  # what kiln opens with when the session gives no messages
        self.transcript = messages or ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                                       else [dict(m) for m in prompt or []])
        return {"messages": messages, "tools": tools}

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        self.transcript.append(dict(message))
        messages, done = [], False
        for call in message.get("tool_calls") or []:
            name, args = call_arguments(call)
            try:
                result = self.session.call_tool(name, args)
            except (KeyError, ValueError) as e:  # the session's "unknown tool" / "bad arguments": the policy's
                text = f"error: {e.args[0] if e.args else type(e).__name__}"
            else:
                text = f"error: {result.error}" if result.error is not None else tool_result_text(result)
                done = done or bool(result.done)
            messages.append({"role": "tool", "name": name, "content": text})
        self.transcript += messages
        if message.get("tool_calls") and not done:
            return {"messages": messages}
        return {"messages": messages, "done": True, "reward": self.final_reward()}

    def final_reward(self) -> float | None:
        """verify(transcript)'s env_reward, asked once per episode (kiln asks again once it ends the episode)."""
        if self.verified or self.session is None:
            return None
        self.verified = True
        result = self.session.verify(list(self.transcript))
        reward = getattr(result, "env_reward", None)
        return None if reward is None else float(reward)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()
