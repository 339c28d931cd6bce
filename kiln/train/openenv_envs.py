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

kiln's episode runner calls these through its timeouts (kiln.train.envs): a raise or a hang in OpenEnv code ends
the episode with its message. OpenEnv's TRL bridge drops the tool tokens; here they are the environment's (loss
mask 0) and the policy's calls are the policy's (loss mask 1), as for any kiln environment.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kiln.errors import ConfigError

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


class OpenEnvTools:
    """kiln's protocol over an OpenEnv MCP tool environment (see the module docstring)."""

    def __init__(self, env: Any):
        _, self.mcp = _openenv()
        self.env = env

    def reset(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        self.env.reset(seed=seed)
        listed = self.env.step(self.mcp.ListToolsAction())
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema or {"type": "object",
                                                                                    "properties": {}}}}
                 for t in listed.tools]
        return {"tools": tools}

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls") or []
        if not calls:
            return {"done": True}
        messages, rewards, done = [], [], False
        for call in calls:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            name, args = fn.get("name"), fn.get("arguments") or {}
            if isinstance(args, str):  # a JSON string (OpenAI's layout)
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {}
            obs = self.env.step(self.mcp.CallToolAction(tool_name=str(name), arguments=args if isinstance(args, dict)
                                                        else {}))
            text = f"error: {obs.error.message}" if obs.error is not None else tool_result_text(obs.result)
            messages.append({"role": "tool", "name": str(name), "content": text})
            if obs.reward is not None:
                rewards.append(float(obs.reward))
            done = done or bool(obs.done)
        return {"messages": messages, "done": done, "reward": sum(rewards) if rewards else None}

    def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            self.env.close()
