"""What the engine's outputs become on the wire: log-probs in OpenAI's two shapes (chat's `content` list with
`top_logprobs`, completions' legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`), and one
completion's pieces gathered for a non-streamed answer."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from tokenizers import decoders


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as text, special tokens included (a piece of a multi-byte character shows as U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted: bytes that print as themselves keep their code
    point, the other 68 take 256, 257, ... in byte order (GPT-2's table, which every byte-level BPE shares)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in set(kept)]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """A token's own bytes (OpenAI's `bytes`): for a byte-level BPE the bytes it stands for, so the pieces of a
    multi-byte character join up; otherwise its text's UTF-8 (`text`: token_text's)."""
    backend = getattr(tokenizer, "backend", None)
    piece = None
    if backend is not None and isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        piece = backend.id_to_token(token_id)
    table = _byte_of_char()
    if piece is not None and all(ch in table for ch in piece):
        return [table[ch] for ch in piece]
    return list(text.encode("utf-8"))  # a special token, or not byte-level


def _lp(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM sends -9999.0 the same way)
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], n_top: int) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for these tokens."""
    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        text = token_text(tokenizer, t)
        alts = top[i][:n_top] if i < len(top) else []
        out.append({"token": text, "logprob": _lp(lp), "bytes": token_bytes(tokenizer, t, text),
                    "top_logprobs": [{"token": (a := token_text(tokenizer, tid)), "logprob": _lp(alp),
                                      "bytes": token_bytes(tokenizer, tid, a)} for tid, alp in alts]})
    return out


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], n_top: int, offset: int) -> dict[str, Any]:
    """Completions' legacy log-probs for these tokens; `offset` is where the first one's text starts."""
    tokens, offsets = [], []
    for t in token_ids:
        text = token_text(tokenizer, t)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
    tops = [{token_text(tokenizer, tid): _lp(alp) for tid, alp in (top[i][:n_top] if i < len(top) else [])}
            for i in range(len(token_ids))]
    return {"tokens": tokens, "token_logprobs": [_lp(x) for x in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


@dataclass
class Gathered:
    """One completion's outputs, step by step, until it finished."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: Any) -> None:
        self.text += out.text
        self.token_ids += list(out.token_ids)
        self.logprobs += list(out.logprobs or [])
        self.top += [list(t) for t in (out.top_logprobs or [])]
        if out.finished:
            self.finish_reason = out.finish_reason
