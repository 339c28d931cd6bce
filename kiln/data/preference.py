"""Preference pairs: rows `{"prompt", "chosen", "rejected"}` -> token ids, tokenized as TRL 1.16's DPOTrainer.

A row is standard (three strings) or conversational (`prompt` a message list, `chosen` / `rejected`
assistant message lists; with no `prompt`, the leading messages `chosen` and `rejected` share are
the prompt, as TRL's `extract_prompt`). As TRL does:
- standard: EOS text appended to `chosen` and `rejected` unless they end with it; `prompt` and
  `prompt + chosen` tokenized as text with the tokenizer's special tokens (its post-processor);
- conversational: the prompt rendered with the generation prompt, `prompt + chosen` rendered whole,
  both tokenized without special tokens (what `apply_chat_template(tokenize=True)` does);
- the completion starts where the tokenized prompt and prompt + completion first differ (the shorter
  of the two pairs' common prefixes), so a prompt that tokenizes differently alone is cut there;
- `max_length` keeps the start of each sequence; a pair whose prompt alone fills it is dropped.
Each pair becomes one example: both sequences, their completion masks and lengths, and its row index
(the key into precomputed reference log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub import Tokenizer

Example = dict[str, torch.Tensor]
__all__ = ["PreferenceStats", "encode_preferences", "pair_texts"]


@dataclass
class PreferenceStats:
    pairs: int = 0
    dropped: int = 0        # prompt alone fills max_length
    truncated: int = 0      # sequences cut to max_length
    prompt_cut: int = 0     # pairs whose tokenized prompt is not a prefix of prompt + completion
    identical: int = 0      # kept pairs whose chosen and rejected tokens are the same: no preference to learn

    def line(self) -> str:
        return (f"{self.pairs} preference pairs; {self.dropped} dropped (prompt fills max_length), "
                f"{self.truncated} sequences truncated, {self.prompt_cut} prompts cut where the tokens diverge"
                + (f"; {self.identical} with chosen = rejected (no signal)" if self.identical else ""))


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _check_messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    if not _is_messages(value) or not value:
        raise KilnError(f"{where}: {key!r} must be a string or a non-empty list of {{role, content}} messages")
    for i, m in enumerate(value):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise KilnError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content'")
    return value


def pair_texts(record: Record) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of one row, checked: three strings, or three message lists."""
    f, where = record.fields, record.where
    missing = [k for k in ("chosen", "rejected") if k not in f]
    if missing:
        have = ", ".join(sorted(f)) or "none"
        raise KilnError(f"{where}: a preference row needs 'chosen' and 'rejected'; missing "
                        f"{' and '.join(repr(k) for k in missing)} (fields here: {have})")
    chosen, rejected = f["chosen"], f["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = f.get("prompt")
        if not isinstance(prompt, str):
            raise KilnError(f"{where}: 'chosen' and 'rejected' are strings, so 'prompt' must be a string too "
                            f"(got {type(prompt).__name__})")
        return prompt, chosen, rejected
    chosen = _check_messages(chosen, "chosen", where)
    rejected = _check_messages(rejected, "rejected", where)
    if "prompt" in f:
        return _check_messages(f["prompt"], "prompt", where), chosen, rejected
    shared = 0  # TRL's extract_prompt: the messages both start with are the prompt
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or shared == min(len(chosen), len(rejected)):
        raise KilnError(f"{where}: no 'prompt', and 'chosen' and 'rejected' share no leading messages to take "
                        "it from (or one is all prompt)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_preferences(records: list[Record], tokenizer: Tokenizer, max_length: int) -> tuple[list[Example], PreferenceStats]:
    """Examples (chosen_ids, chosen_mask, chosen_len, rejected_ids, rejected_mask, rejected_len, index) and
    what happened; `index` counts the kept pairs 0, 1, ... in file order."""
    if max_length < 2:
        raise KilnError(f"data.max_length must be at least 2, got {max_length}")
    stats = PreferenceStats()
    eos = tokenizer.specials.get("eos_token")
    template = None
    out: list[Example] = []
    for r in records:
        prompt, chosen, rejected = pair_texts(r)
        if isinstance(prompt, str):
            if eos is None:
                raise KilnError(f"{r.where}: standard (string) pairs get the EOS token appended, as TRL does, "
                                "but the tokenizer names no eos_token")
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos

            def ids(text: str) -> list[int]:
                return list(tokenizer.backend.encode(text, add_special_tokens=True).ids)

            p, pc, pr = ids(prompt), ids(prompt + chosen), ids(prompt + rejected)
        else:
            template = template or tokenizer.chat()

            def render(messages: list[dict[str, Any]], gen: bool = False) -> list[int]:
                text = template.render(messages, add_generation_prompt=gen)  # noqa: B023 - called in this iteration
                return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)

            p, pc, pr = render(prompt, True), render(prompt + chosen), render(prompt + rejected)
        cut = min(_prefix(p, pc), _prefix(p, pr))
        stats.prompt_cut += cut < len(p)
        if cut >= max_length:
            stats.dropped += 1
            continue
        example: Example = {}
        for name, seq in (("chosen", pc), ("rejected", pr)):
            if len(seq) > max_length:
                stats.truncated += 1
            seq = seq[:max_length]
            if len(seq) <= cut:
                raise KilnError(f"{r.where}: the {name} completion is empty once tokenized")
            example[f"{name}_ids"] = torch.tensor(seq, dtype=torch.long)
            example[f"{name}_mask"] = torch.tensor([0] * cut + [1] * (len(seq) - cut), dtype=torch.long)
            example[f"{name}_len"] = torch.tensor(len(seq), dtype=torch.long)
        stats.identical += torch.equal(example["chosen_ids"], example["rejected_ids"])
        example["index"] = torch.tensor(len(out), dtype=torch.long)
        out.append(example)
        stats.pairs += 1
    return out, stats
