"""Multi-turn GRPO rollouts ([grpo] env / tools): episodes of policy turns and environment messages, as tokens.

An episode's prompt is rendered with its tools once. Each turn the policy samples to its end-of-turn token (loss
mask 1, log-probs kept); the turn's text is parsed into an assistant message (transformers' `parse_response`
where the tokenizer declares a `response_template`, else a parser from PARSERS that the template's layout
matches); function tools are called, then the environment's `step`; what they return is appended as tokens: the
difference of two renderings of a short conversation (the assistant message, then it and the new messages with
the generation prompt), cut after the end-of-turn token (loss mask 0). History is never re-rendered, so the
trainer sees exactly the sampled tokens. The rendering is kiln.data.turns', the path SFT tool rows are encoded
with, so SFT and a rollout give one conversation the same tokens and mask. An episode stops on `done`, a step with no message, `max_turns`, the
turn or episode token budget (a turn cut by a budget still goes to the environment's `step`, to be scored; its
tool calls are not run), or a failure of user code (the episode then carries no loss and no reward, and its
message is kept).

`sample_turns` is the one place tokens are drawn: on the generation engine (kiln.train.grpo_engine) each active
episode's history is one request, so the blocks of its earlier turns, remembered by their content, are reused
instead of prefilled again (kiln's earlier generate loop, the fallback for models the engine does not run, was
removed: such models are refused by GRPORun.decoder).  # engfsdp
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.data.turns import TurnCodec, TurnError, Turns
from kiln.errors import ConfigError
from kiln.hub.chat import parse_reply
from kiln.train.envs import EnvSpec, EpisodeError, Tool, TRLEnvironment, as_obs, as_tool, call_user, tool_message
from kiln.train.grpo_engine import EngineDecoder

_PROBE_TOOL = {"type": "function", "function": {"name": "kiln_probe_tool", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = [{"type": "function", "function": {"name": "kiln_probe_tool", "arguments": {}}}]


@dataclass(frozen=True)
class Parser:
    """A tool-call layout kiln parses: `marker` (a text the template writes around calls) -> parse(text)."""
    name: str
    marker: str
    parse: Callable[[str], dict[str, Any]]


PARSERS = [Parser("hermes", "<tool_call>", parse_reply)]  # Qwen 2.5 / 3, Hermes


class Dialect:
    """A tokenizer's chat template as rollouts use it: render, parse a turn, the tokens between turns.
    Built by `check`, which refuses (by message, before any work) a template that cannot run episodes."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]):
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self.template = tokenizer.chat()
        self.eos_texts = [t for t in (tokenizer.id_to_token(i) for i in self.eos_ids) if t]
        # the turn-by-turn rendering SFT tool rows use too (kiln.data.turns): one masking path
        self.codec = TurnCodec(tokenizer, self.template, self.eos_texts)
        schema = tokenizer.config.get("response_template") or tokenizer.config.get("response_schema")
        self.response_template = schema if isinstance(schema, dict) else None
        self.parser: Parser | None = None

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return self.codec.render(messages, tools, generation)

    def check(self) -> Dialect:
        where = self.template.source
        if not self.eos_texts:
            raise ConfigError("[grpo] env/tools: the model has no end-of-turn (EOS) token to end a turn on")
        probe = [{"role": "user", "content": "kiln probe"}]
        if "kiln_probe_tool" not in self.render(probe, [_PROBE_TOOL], True):
            raise ConfigError(f"{where}: the chat template does not render `tools` (a tool's name is missing from "
                              "the rendered prompt): episodes with tools need a template that shows them")
        if self.response_template is None:
            source = self.tokenizer.chat_template or ""
            self.parser = next((p for p in PARSERS if p.marker in source), None)
            if self.parser is None:
                raise ConfigError(f"{where}: no parser for this template's tool calls (the tokenizer has no "
                                  f"response_template, and the template writes none of kiln's layouts: "
                                  f"{', '.join(p.marker for p in PARSERS)})")
        for _role, msgs in (("tool", [{"role": "tool", "name": "kiln_probe_tool", "content": "1"}]),
                           ("user", [{"role": "user", "content": "again"}])):
            try:
                self.suffix({"role": "assistant", "content": "ok", "tool_calls": _PROBE_CALL}, msgs, [_PROBE_TOOL])
            except EpisodeError as e:
                raise ConfigError(f"{where}: {e}") from None
        return self

    def suffix(self, assistant: dict[str, Any], new: list[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> list[int]:
        """The tokens between the end of the policy's turn and its next turn (kiln.data.turns)."""
        try:
            return self.codec.between(assistant, new, tools)
        except TurnError as e:
            raise EpisodeError(str(e)) from None

    def parse(self, text: str, prefix: str, tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether a tool call failed to parse)."""
        if self.response_template is not None:
            from transformers.utils.chat_parsing.response_parser import parse_response

            try:
                message = parse_response(text, self.response_template, prefix=prefix, tools=tools)
            except Exception:  # noqa: BLE001  (the policy's text: a failure is a parse failure, not an error)
                return {"role": "assistant", "content": text}, True
            return {"role": "assistant", **message}, False
        assert self.parser is not None
        message = self.parser.parse(text)
        failed = text.count(self.parser.marker) > len(message.get("tool_calls", []))
        return message, failed


def sample_turns(decoder: EngineDecoder, contexts: list[list[int]], budgets: list[int], g: Any,
                 gen: torch.Generator | None, pad: int, eos_ids: list[int], device: torch.device
                 ) -> list[tuple[list[int], list[float], bool]]:
    """One turn of each context on the engine: (tokens, their log-probs under logits / temperature, ended on an
    end token), at most budgets[i] tokens (greedy when `gen` is None). (`pad`, `device`: kept for callers; the
    earlier generate-loop path that used them was removed with the loop.)  # engfsdp"""
    return decoder.rollouts.turns(decoder.model, contexts, budgets, gen, eos_ids, g.max_episode_tokens)


@dataclass
class Episode:
    row: int
    env: Any = None
    tools: dict[str, Tool] = field(default_factory=dict)
    schemas: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)   # the conversation (opening + what followed)
    opening: int = 0                                                # how many of `messages` the prompt holds
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)                    # everything after the prompt
    mask: list[int] = field(default_factory=list)                   # 1: the policy's tokens
    logps: list[float] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)      # per step
    turns: int = 0
    end: str | None = None      # done | no_message | max_turns | budget | truncated | error
    error: str | None = None
    parse_failures: int = 0
    tool_failures: int = 0

    @property
    def after(self) -> Turns:
        """`ids` and `mask` (the same lists) as kiln.data.turns appends to them."""
        return Turns(self.ids, self.mask)

    @property
    def reward(self) -> float | None:
        got = [r for r in self.rewards if r is not None]
        return sum(got) if got and self.end != "error" else None


class EpisodeRunner:
    """Runs a batch of episodes in lockstep turns (every active episode samples its turn in one batch)."""

    def __init__(self, spec: EnvSpec, dialect: Dialect, g: Any):
        self.spec, self.dialect, self.g = spec, dialect, g

    def _fail(self, e: Episode, err: EpisodeError) -> None:
        e.end, e.error = "error", str(err)

    def _open(self, e: Episode, row: dict[str, Any], seed: int, fallback_ids: list[int]) -> None:
        t = self.spec.timeout
        e.prompt_ids = fallback_ids
        try:
            e.env = self.spec.make()
            obs = as_obs(call_user(e.env.reset, row, seed, timeout=t, what="env.reset"), "env.reset")
            messages = obs.messages or ([{"role": "user", "content": row["prompt"]}] if isinstance(row.get("prompt"), str)
                                        else list(row.get("prompt") or []))
            if not messages:
                raise EpisodeError("env.reset gave no messages and the row has no prompt")
            tools = [as_tool(x, "env.reset tools") for x in (obs.tools or [])] + self.spec.tools
            e.tools = {tool.name: tool for tool in tools}
            e.schemas = [tool.schema for tool in tools]
            e.messages, e.opening = [dict(m) for m in messages], len(messages)
            e.prompt_ids = self.dialect.codec.opening(e.messages, e.schemas)
            e.rewards.append(obs.reward)
            if obs.done:
                e.end = "done"
        except EpisodeError as err:
            self._fail(e, err)
        except Exception as err:  # noqa: BLE001  (a malformed tool list, a template refusing the messages)
            self._fail(e, EpisodeError(f"env.reset: {type(err).__name__}: {err}"))

    def run(self, decoder: Any, rows: list[dict[str, Any]], row_ids: list[int], fallback: list[list[int]],
            seeds: list[int], gen: torch.Generator | None, pad: int, device: torch.device) -> list[Episode]:
        g, d = self.g, self.dialect
        episodes = [Episode(r) for r in row_ids]
        for e, row, seed, ids in zip(episodes, rows, seeds, fallback):
            self._open(e, row, seed, ids)
        for turn in range(g.max_turns):
            active = [e for e in episodes if e.end is None]
            if not active:
                break
            budgets = [min(g.max_new_tokens, g.max_episode_tokens - len(e.ids)) for e in active]
            outs = sample_turns(decoder, [e.prompt_ids + e.ids for e in active], budgets, g, gen, pad, d.eos_ids,
                                device)
            for e, _budget, (toks, lps, ended) in zip(active, budgets, outs):
                prefix_ids = e.prompt_ids + e.ids
                e.after.assistant(toks)
                e.logps += lps
                e.turns += 1
                # a turn cut by a budget still goes to the environment (which scores what was written), but
                # the episode ends there: without its end-of-turn token no further turn can follow
                self._after_turn(e, toks if not ended else toks[:-1], prefix_ids, turn, final=not ended)
                if not ended and e.end != "error":
                    e.end = "budget" if len(e.ids) >= g.max_episode_tokens else "truncated"
        for e in episodes:
            if e.end is None:
                e.end = "max_turns"
            if callable(getattr(e.env, "final_reward", None)) and e.end != "error":
                what = "env.get_reward" if isinstance(e.env, TRLEnvironment) else "env.final_reward"
                try:
                    reward = call_user(e.env.final_reward, timeout=self.spec.timeout, what=what)
                    e.rewards.append(as_obs({"reward": reward}, what).reward)
                except EpisodeError as err:
                    self._fail(e, err)
            if e.env is not None and callable(getattr(e.env, "close", None)):
                try:
                    call_user(e.env.close, timeout=self.spec.timeout, what="env.close")
                except EpisodeError as err:
                    if e.end != "error":
                        self._fail(e, err)
        return episodes

    def _after_turn(self, e: Episode, toks: list[int], prefix_ids: list[int], turn: int, final: bool) -> None:
        """The turn's text `toks` (its end-of-turn token left off) parsed and answered: tool calls, then the
        environment's step; then the next turn's opening tokens, unless the episode ends (`final`: it does)."""
        g, d, t = self.g, self.dialect, self.spec.timeout
        text = d.tokenizer.decode(toks, skip_special_tokens=False)
        message, failed = d.parse(text, d.tokenizer.decode(prefix_ids, skip_special_tokens=False), e.schemas)
        e.parse_failures += int(failed)
        new: list[dict[str, Any]] = []
        for call in [] if final else message.get("tool_calls") or []:  # a cut turn's calls are not run
            name = call.get("function", {}).get("name") if isinstance(call, dict) else None
            if name in e.tools and e.tools[name].fn is not None:
                msg, bad = tool_message(e.tools, call, t)
                new.append(msg)
                e.tool_failures += int(bad)
        try:
            obs = as_obs(call_user(e.env.step, message, timeout=t, what="env.step"), "env.step")
        except EpisodeError as err:
            self._fail(e, err)
            return
        e.messages.append(message)
        new += obs.messages
        e.rewards.append(obs.reward)
        if final:
            return
        if obs.done:
            e.end = "done"
        elif not new:
            e.end = "no_message"
        elif turn + 1 >= g.max_turns:
            e.end = "max_turns"
        if e.end is not None:
            return
        try:
            suffix = d.suffix(message, new, e.schemas)
        except EpisodeError as err:
            self._fail(e, err)
            return
        except Exception as err:  # noqa: BLE001  (the template refusing the environment's messages)
            self._fail(e, EpisodeError(f"rendering the environment's messages: {type(err).__name__}: {err}"))
            return
        if len(e.ids) + len(suffix) >= g.max_episode_tokens:  # no room for the next turn: drop the messages (TRL's)
            e.end = "budget"
            return
        e.messages += new
        e.after.other(suffix)
        e.logps += [0.0] * len(suffix)


def env_column(episodes: list[Episode]) -> list[float | None]:
    return [e.reward for e in episodes]


def inner_envs(episodes: list[Episode]) -> list[Any]:
    """What TRL passes reward functions as `environments`: each episode's environment object (TRL's own class)."""
    return [e.env.inner if isinstance(e.env, TRLEnvironment) else e.env for e in episodes]


def episode_record(e: Episode, step: int, per_func: dict[str, float]) -> dict[str, Any]:
    """One line of RUN_DIR/rollouts.jsonl."""
    return {"step": step, "row": e.row, "messages": e.messages, "prompt_ids": e.prompt_ids, "completion_ids": e.ids,
            "loss_mask": e.mask, "step_rewards": e.rewards, "reward": e.reward, "rewards": per_func,
            "turns": e.turns, "end": e.end, "error": e.error, "parse_failures": e.parse_failures,
            "tool_failures": e.tool_failures}


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, default=str, ensure_ascii=False)


def episode_seed(seed: int, index: int) -> int:
    """The seed `reset` gets for episode `index` of a micro-batch sampled with `seed`."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"kiln-env:{seed}:{index}".encode()).digest()[:8], "little") >> 1


def to_micro(episodes: list[Episode], pad: int, eos_ids: list[int], device: torch.device) -> dict[str, Any]:
    """The episodes as the trainer's micro-batch: prompts left-padded to P, everything after them right-padded to
    C (policy and environment tokens; `completion_mask` 1 on all of them, `loss_mask` only on the policy's, none
    for a failed episode), the sampler's log-probs on the policy's tokens."""
    n = len(episodes)
    width = max(len(e.prompt_ids) for e in episodes)
    c = max(1, max(len(e.ids) for e in episodes))
    ids = torch.full((n, width + c), pad, dtype=torch.long)
    attn = torch.zeros((n, width + c), dtype=torch.long)
    loss = torch.zeros((n, c), dtype=torch.long)
    logps = torch.zeros((n, c), dtype=torch.float32)
    for i, e in enumerate(episodes):
        p, k = len(e.prompt_ids), len(e.ids)
        ids[i, width - p: width] = torch.tensor(e.prompt_ids)
        attn[i, width - p: width + k] = 1
        if k:
            ids[i, width: width + k] = torch.tensor(e.ids)
            if e.end != "error":
                loss[i, :k] = torch.tensor(e.mask)
                logps[i, :k] = torch.tensor(e.logps, dtype=torch.float32)
    truncated = torch.tensor([bool(e.ids) and e.ids[-1] not in eos_ids and e.end != "error" for e in episodes])
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "prompt_len": width,
            "completion_mask": attn[:, width:].to(device), "loss_mask": (loss * attn[:, width:]).to(device),
            "truncated": truncated.to(device), "sampler_logps": (logps * loss).to(device)}


ENV_COLUMN = "kiln_env_reward"  # the column the `env` reward function reads (each episode's summed step rewards)


def env_reward(prompts: list, completions: list, **columns: Any) -> list[float | None]:
    """The environment's own reward of each episode (the sum of its steps' rewards; None when it gave none)."""
    return list(columns[ENV_COLUMN])
