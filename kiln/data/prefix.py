"""Only as much of a long text as its first `max_length` tokens need.

A fast tokenizer builds every token of a text it encodes (ids, offsets, word ids: ~200 bytes a token)
before truncation drops them, so a 10 MB row took ~2 GB to keep 512 tokens. `enough_prefix` tokenizes
growing prefixes (16 x max_length characters, then x4) and stops at the first one whose leading tokens
cannot depend on the cut: the first max_length tokens all belong to words that end before the
prefix's last word begins, `MARGIN` characters or more before the cut. Normalizers, pre-tokenizers and
BPE / WordPiece / Unigram models look at most a few characters past a word's end (a lookahead, a
combining mark), so those words tokenize as in the whole text; the post-processor (specials) and
truncation see the same leading tokens. A text with no such prefix (one giant word) is tokenized whole,
as before. tests/data/test_prefix.py checks the result against whole-text encoding, cuts mid-word included.
"""

from __future__ import annotations

from typing import Any

MARGIN = 64  # characters between the last kept token's word and the cut
_FIRST = 16  # characters per kept token in the first prefix tried (words average ~4-6 characters a token)


def enough_prefix(backend: Any, text: str) -> str:
    """`text`, or a prefix of it whose encoding under `backend` (a tokenizers.Tokenizer that truncates on the
    right to max_length tokens) is the whole text's; `text` itself if the backend does not truncate so."""
    how = backend.truncation
    if how is None or how.get("direction", "right") != "right":
        return text
    max_length = int(how["max_length"])
    n = max(_FIRST * max_length, 4 * MARGIN)
    if len(text) <= n:
        return text
    backend.no_truncation()
    try:
        while n < len(text):
            enc = backend.encode(text[:n], add_special_tokens=False)
            if _leading_tokens_settled(enc, n, max_length):
                return text[:n]
            n *= 4
    finally:
        backend.enable_truncation(**how)
    return text


def _leading_tokens_settled(enc: Any, cut: int, max_length: int) -> bool:
    """Whether the first `max_length` tokens of the encoding of text[:cut] lie in words that end before the
    last word's start and at least MARGIN characters before the cut."""
    words, offsets = enc.word_ids, enc.offsets
    if len(words) <= max_length or words[-1] is None:
        return False
    last_word = words[-1]
    last_start = min(s for (s, _), w in zip(offsets, words) if w == last_word)
    kept_words = set(words[:max_length])
    if last_word in kept_words or None in kept_words:
        return False
    end = max(e for (_, e), w in zip(offsets, words) if w in kept_words)
    return end <= min(last_start, cut - MARGIN)
