"""A request's sampling parameters (the generation engine's contract, issue 39).

The names and meanings follow the OpenAI API (presence / frequency penalties over the output tokens,
top_logprobs up to 20) and Hugging Face / vLLM (repetition_penalty over prompt + output, top_k, min_p).
`validate()` is the one place bad values are caught; the message names the field and the value, so the
server can answer a 400 with it and the CLI can print it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kiln.errors import KilnError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0.0 = greedy (argmax)
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0              # keep tokens with probability >= min_p * the highest probability
    repetition_penalty: float = 1.0  # HF/vLLM semantics over prompt + output tokens
    presence_penalty: float = 0.0   # OpenAI semantics over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None         # per request; completion j of n draws from its own generator
    stop_token_ids: tuple[int, ...] = ()   # in addition to the model's EOS ids (unless ignore_eos)
    stop: tuple[str, ...] = ()      # stop strings (need a tokenizer); the text is cut before the stop
    logprobs: bool = False          # return the chosen tokens' log-probs
    top_logprobs: int = 0           # and the top-n alternatives per position
    n: int = 1                      # completions per request (they share the prompt's KV blocks)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # a list from JSON becomes a tuple (the dataclass stays hashable); one stop string is a tuple of one,
        # not a tuple of its characters
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, list):
            object.__setattr__(self, "stop", tuple(stop))
        elif stop is not self.stop:
            object.__setattr__(self, "stop", stop)
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise KilnError naming the first field whose value cannot be used (`vocab_size`: also check that
        stop_token_ids are token ids of the model)."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        _require("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0,
                 "a finite number >= 0 (0 = greedy)")
        _require("top_k", self.top_k, self.top_k >= 0, "an integer >= 0 (0 = off)")
        _require("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        _require("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]")
        _require("repetition_penalty", self.repetition_penalty,
                 math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(name, value, math.isfinite(value), "a finite number")
        _require("max_tokens", self.max_tokens, self.max_tokens >= 1, "an integer >= 1")
        _require("n", self.n, self.n >= 1, "an integer >= 1")
        _require("top_logprobs", self.top_logprobs, 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                 f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise KilnError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        for s in self.stop:
            _require("stop", self.stop, s != "", "non-empty strings")
        for t in self.stop_token_ids:
            ok = t >= 0 and (vocab_size is None or t < vocab_size)
            bound = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the model's vocabulary)"
            _require("stop_token_ids", self.stop_token_ids, ok, f"token ids {bound}; {t} is not")


# field -> the Python types its value may have (bool is an int in Python, so ints exclude it explicitly)
_TYPES = {
    "max_tokens": int, "top_k": int, "n": int, "top_logprobs": int,
    "temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float,
    "logprobs": bool, "ignore_eos": bool,
}


def _check_type(name: str, value: object) -> None:
    if name == "seed":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        _require(name, value, ok, "an integer or None")
    elif name == "stop":
        _require(name, value, isinstance(value, tuple) and all(isinstance(s, str) for s in value),
                 "a string or a list of strings")
    elif name == "stop_token_ids":
        ok = isinstance(value, tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        _require(name, value, ok, "a list of integer token ids")
    elif _TYPES[name] is bool:
        _require(name, value, isinstance(value, bool), "true or false")
    elif _TYPES[name] is int:
        _require(name, value, isinstance(value, int) and not isinstance(value, bool), "an integer")
    else:
        _require(name, value, isinstance(value, (int, float)) and not isinstance(value, bool), "a number")


def _require(name: str, value: object, ok: bool, what: str) -> None:
    if not ok:
        raise KilnError(f"SamplingParams.{name}={value!r}: must be {what}")
