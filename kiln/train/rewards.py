"""Reward functions for RL with verifiable rewards ([grpo]): finding them, calling them, checking what they return.

A reward is named in the run config as `"module:function"` (module.py found beside data.train, which is the run
TOML's folder when the prompts sit beside it, then on sys.path) or as a built-in: `exact_match` (the completion, stripped, equals the row's `answer` column),
`format` (the completion matches `grpo.format_pattern` as a whole), `length` (1 - completion tokens /
max_new_tokens: shorter scores higher). Every function has TRL's signature,
`f(prompts, completions, completion_ids, **columns) -> list[float | None]`, so a TRL user's function runs
unchanged: `prompts` as the data holds them (strings or message lists), `completions` decoded (a string, or
`[{"role": "assistant", "content": ...}]` for message-list prompts), the data's other columns one list each.
None means "does not apply" (as TRL); a wrong length or a NaN/inf is an error naming the function and the row.

A user's function ("module:function") runs in a daemon thread under `grpo.reward_timeout`
(kiln.train.envs.call_user): a call that raises or does not return in time gives None for its completions, with a
warning and the counts `reward_errors` / `reward_timeouts` in the metrics; `grpo.reward_max_failures` failing
calls of one function in a row stop the run by message. A call still running 2 s (usercode.STOP_GRACE) after the run
is told to stop (SIGTERM / SIGINT) is abandoned (None, not a failure), so the stop's checkpoint is written in time.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ConfigError, KilnError
from kiln.train.usercode import Abandoned, UserTimeout, call_user

RewardFn = Callable[..., Sequence[float | None]]


def exact_match(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """1.0 where the completion's text (stripped) equals str(answer) (stripped), else 0.0 (`answer`: a column of
    the prompts file, checked before the first rollout by `required_columns`)."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's last message."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def format_reward(pattern: str) -> RewardFn:
    """1.0 where the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts: list, completions: list, **_: Any) -> list[float]:
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]

    return format


def length_reward(max_new_tokens: int) -> RewardFn:
    """1 - (completion tokens / max_new_tokens): shorter completions score higher, in [0, 1]."""

    def length(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float]:
        return [1.0 - len(ids) / max_new_tokens for ids in completion_ids]

    return length


BUILTINS = ("exact_match", "format", "length")


@dataclass
class Reward:
    name: str          # the metric's name: reward/<name>
    fn: RewardFn
    weight: float
    spec: str = ""     # as the config names it ("module:function"); set for user code, which runs guarded


class RewardGuard:
    """Runs users' reward functions under a timeout, counts their failures, stops the run after too many in a row."""

    def __init__(self, timeout: float, max_failures: int):
        self.timeout, self.max_failures = timeout, max_failures
        self.in_a_row: dict[str, int] = {}
        self.errors = self.timeouts = 0   # since the last `take`

    def take(self) -> tuple[int, int]:
        """(errors, timeouts) counted since the last call."""
        out = (self.errors, self.timeouts)
        self.errors = self.timeouts = 0
        return out

    def call(self, r: Reward, n: int, where: str, kwargs: dict[str, Any]) -> Any:
        """r.fn(**kwargs) in a worker; None for each of the `n` completions when it raises, hangs or is abandoned."""
        what = f"reward function {r.name!r} ({r.spec})"
        try:
            values = call_user(r.fn, timeout=self.timeout, what=what, key="grpo.reward_timeout", **kwargs)
        except Abandoned as e:
            print(f"warning: {e}; its {n} rewards are None", file=sys.stderr, flush=True)
            return [None] * n
        except KilnError as e:  # raised (EpisodeError) or timed out (UserTimeout)
            timed_out = isinstance(e, UserTimeout)
            if timed_out:
                self.timeouts += 1
            else:
                self.errors += 1
            k = self.in_a_row[r.name] = self.in_a_row.get(r.name, 0) + 1
            detail = f"{e} (on a batch whose first prompt is {where})"
            if k >= self.max_failures:
                raise KilnError(f"stopping: {what} failed {k} calls in a row (grpo.reward_max_failures = "
                                f"{self.max_failures}, grpo.reward_timeout = {self.timeout:g} s); the last: {detail}") \
                    from None
            print(f"warning: {detail}; its {n} rewards are None ({k} failing call(s) in a row; the run stops at "
                  f"{self.max_failures})", file=sys.stderr, flush=True)
            return [None] * n
        self.in_a_row[r.name] = 0
        return values


def _import(module: str, search: Sequence[Path], key: str = "grpo.rewards") -> Any:
    """`module` from the first of `search` that has it as module.py (or a package), else from sys.path; errors
    name the config `key`."""
    for folder in search:
        if (folder / f"{module}.py").is_file() or (folder / module / "__init__.py").is_file():
            name = f"kiln_rewards_{abs(hash(str(folder)))}_{module}"
            if name in sys.modules:
                return sys.modules[name]
            path = folder / f"{module}.py" if (folder / f"{module}.py").is_file() else folder / module / "__init__.py"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception as e:  # noqa: BLE001 - a user's module may raise anything on import; reported, not hidden
                del sys.modules[name]
                raise ConfigError(f"{key}: importing {path} failed: {type(e).__name__}: {e}") from None
            return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not module.startswith(f"{e.name}."):
            raise ConfigError(f"{key}: importing {module!r} failed: {e}") from None
        where = ", ".join(str(f) for f in search)
        raise ConfigError(f"{key}: no module {module!r} (looked for {module}.py in {where} and on sys.path)") \
            from None


def import_attr(spec: str, search: Sequence[Path], key: str) -> Any:
    """The object "module:attr" (attr may be dotted) names, imported as reward modules are; errors name `key`."""
    if ":" not in spec:
        raise ConfigError(f"{key}: {spec!r} is not \"module:name\"")
    module, _, attr = spec.partition(":")
    target: Any = _import(module, search, key)
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{key}: module {module!r} has no {attr!r}")
    return target


def resolve_rewards(names: Sequence[str], weights: Sequence[float] | None, search: Sequence[Path], *,
                    format_pattern: str | None, max_new_tokens: int, env: bool = False) -> list[Reward]:
    """The reward functions the config names, with their weights (default 1.0 each); none is allowed when an
    environment (`env`) gives rewards."""
    if not names and not env:
        raise ConfigError("grpo.rewards is empty: name at least one reward function (\"module:function\", a reward model \"model:DIR\" or one "
                          f"of {', '.join(BUILTINS)})")
    if weights is not None and len(weights) != len(names):
        raise ConfigError(f"grpo.reward_weights has {len(weights)} values for {len(names)} grpo.rewards")
    out = []
    for i, spec in enumerate(names):
        weight = 1.0 if weights is None else float(weights[i])
        if spec.startswith("model:"):  # a reward model kiln trained (task = "reward-model"): a directory or run
            from kiln.train.reward_model import load_reward  # loads torch models: only when a config names one

            fn = load_reward(spec[len("model:"):], search=search)
            out.append(Reward(fn.__name__, fn, weight))
            continue
        if ":" not in spec:
            if spec == "exact_match":
                out.append(Reward(spec, exact_match, weight))
            elif spec == "format":
                if not format_pattern:
                    raise ConfigError("grpo.rewards names 'format': set grpo.format_pattern (a regular expression the "
                                      "whole completion must match)")
                out.append(Reward(spec, format_reward(format_pattern), weight))
            elif spec == "length":
                out.append(Reward(spec, length_reward(max_new_tokens), weight))
            else:
                raise ConfigError(f"grpo.rewards: {spec!r} is neither \"module:function\" nor a built-in "
                                  f"({', '.join(BUILTINS)})")
            continue
        module, _, attr = spec.partition(":")
        fn = _import(module, search)
        target: Any = fn
        for part in attr.split("."):
            target = getattr(target, part, None)
            if target is None:
                raise ConfigError(f"grpo.rewards: module {module!r} ({getattr(fn, '__file__', '?')}) has no "
                                  f"function {attr!r}")
        if not callable(target):
            raise ConfigError(f"grpo.rewards: {spec} is not callable")
        out.append(Reward(attr.split(".")[-1], target, weight, spec=spec))
    names_seen = [r.name for r in out]
    dup = next((n for n in names_seen if names_seen.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"grpo.rewards names {dup!r} twice (each function's metric is reward/<name>)")
    return out


GIVEN = frozenset({"prompts", "completions", "completion_ids"})  # what every reward call passes besides the columns


def required_columns(fn: RewardFn) -> list[str]:
    """The prompts file's columns a reward function cannot do without: its parameters with no default, beyond the
    ones every call passes (TRL passes the dataset's other columns as keyword arguments)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to check
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in GIVEN
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_columns(rewards: Sequence[Reward], records: Sequence[Any], source: str) -> None:
    """Refuse, before any rollout, a prompts file whose rows lack a column a reward function requires (naming the
    function, the column and the first row without it)."""
    for r in rewards:
        for column in required_columns(r.fn):
            missing = next((rec for rec in records if column not in rec.fields), None)
            if missing is not None:
                have = ", ".join(sorted(missing.fields)) or "none"
                raise ConfigError(f"{missing.where}: the reward function {r.name!r} takes a {column!r} column, and "
                                  f"this row of {source} has none (its columns: {have})")


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], rows: Sequence[str], guard: RewardGuard | None = None) -> torch.Tensor:
    """(N, F) float32 rewards of N completions under F functions (NaN where a function returned None).
    `rows[i]` says where completion i's prompt comes from (file:line), for messages. With a `guard`, users'
    functions (those with a spec) run under it; kiln's own (built-ins, reward models) run here."""
    n = len(completions)
    out = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, r in enumerate(rewards):
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        try:
            values = guard.call(r, n, rows[0], kwargs) if guard is not None and r.spec else r.fn(**kwargs)
        except KilnError:
            raise
        except Exception as e:
            raise KilnError(f"reward function {r.name!r} raised {type(e).__name__}: {e} (on a batch whose first "
                            f"prompt is {rows[0]})") from e
        try:
            values = list(values)
        except TypeError:
            raise KilnError(f"reward function {r.name!r} returned {type(values).__name__}, not a list of floats") \
                from None
        if len(values) != n:
            raise KilnError(f"reward function {r.name!r} returned {len(values)} rewards for {n} completions (one per "
                            f"completion expected; batch from {rows[0]})")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = math.nan
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise KilnError(f"reward function {r.name!r} returned {v!r} for completion {i} of {rows[i]}, "
                                "not a number") from None
            if not math.isfinite(f):
                raise KilnError(f"reward function {r.name!r} returned {f} for completion {i} of {rows[i]} "
                                f"(completion: {_text(completions[i])[:80]!r})")
            out[i, j] = f
    return out
