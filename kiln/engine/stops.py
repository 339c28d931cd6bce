"""Incremental detokenization with stop strings, for one generated sequence.

Text is emitted as tokens arrive, but never half a character: a byte-level BPE token may end inside a
multi-byte UTF-8 character (an emoji, a CJK character), and the tokenizer decodes such a tail as U+FFFD; that
text waits until a later token completes the character. Each step decodes a short window (a few tokens of
context before the unemitted ones), so a tokenizer whose decoding depends on the previous token (a
SentencePiece word-start space, a WordPiece "##" piece) gives the same text as decoding the whole sequence.

Stop strings are matched on the decoded text, so one may span any number of tokens or start inside one. The
emitted text stops before the first stop string that completes; text that could be the start of a stop string
is held back until a later token decides it (`finish()` releases it when the sequence ends otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kiln.errors import KilnError

CONTEXT = 5  # prompt tokens decoded before the first new one: enough for any word-start rule we know of
PARTIAL = "\ufffd"  # what a tokenizer's decode gives for an incomplete UTF-8 sequence


class Decodes(Protocol):
    """What Detokenizer needs of a tokenizer: kiln.hub.Tokenizer, a transformers tokenizer and a
    `tokenizers.Tokenizer` all have it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Incremental text of one sequence: push(token_id) -> (text delta safe to emit, stopped on a stop string).

    `text` is everything emitted so far (cut before the stop string once stopped); `stop_string` is the one
    that matched. After a stop, push() emits nothing more."""

    def __init__(self, tokenizer: Decodes, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        if any(not isinstance(s, str) or not s for s in stop):
            raise KilnError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None
        # the decode window: ids[:read] were decoded already (ids[:read] is the context that fixes how the next
        # token's text starts); ids[read:] are tokens whose text is not decided yet
        self._ids = [int(t) for t in list(prompt_ids)[-CONTEXT:]]
        self._read = len(self._ids)
        self._pending = ""  # decoded text not emitted yet: it may be the start of a stop string

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token: the text that became safe to emit, and whether a stop string completed."""
        if self.stopped:
            return "", True
        self._ids.append(int(token_id))
        self._pending += self._decode_new(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """The sequence ended without a stop string (EOS, max tokens, cancel): the text still held back (a
        possible start of a stop string, or an incomplete character, decoded as U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._emit(final=True)[0]

    def _decode_new(self, final: bool) -> str:
        """The text the tokens after the context add, or "" while it ends inside a character (unless final)."""
        decode = self.tokenizer.decode
        before = decode(self._ids[: self._read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or (after.endswith(PARTIAL) and not final):
            return ""  # nothing yet (a special token skipped), or a character not complete
        # the window slides: the tokens just decoded become the context of the next ones
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return after[len(before):]

    def _emit(self, final: bool) -> tuple[str, bool]:
        """Move the decided part of the pending text to `text`: up to the first stop string that completed
        (then stop), else up to where a stop string might be starting."""
        hit = min(((i, s) for s in self.stop if (i := self._pending.find(s)) >= 0), default=None)
        if hit is not None:
            out = self._pending[: hit[0]]
            self.text += out
            self._pending = ""
            self.stopped, self.stop_string = True, hit[1]
            return out, True
        keep = 0 if final else _held(self._pending, self.stop)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        self.text += out
        return out, False


def _held(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that is the start of a stop string (0: none)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
