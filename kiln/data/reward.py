"""Reward-model pairs: preference rows -> the chosen and rejected sequences, tokenized as TRL 1.16's RewardTrainer.

The rows are `[dpo]`'s (kiln.data.preference): `{"prompt", "chosen", "rejected"}` as strings or message
lists, and also without `prompt` (each side a whole text or conversation: TRL's implicit prompt), with an
optional float `margin` per row (every row or none). Unlike DPO the prompt is not split off: each side is
`prompt + reply` scored whole. As TRL does:
- standard (strings): the EOS text appended to each side unless it ends with it, then tokenized with the
  tokenizer's special tokens (its post-processor);
- conversational: `prompt + reply` rendered by the chat template (no generation prompt), tokenized without
  special tokens;
- a pair with either side longer than `max_length` is dropped (TRL filters, it does not truncate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.data.preference import _check_messages
from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub import Tokenizer

Example = dict[str, torch.Tensor]
__all__ = ["RewardStats", "encode_reward_pairs", "reward_sides", "side_ids"]


@dataclass
class RewardStats:
    pairs: int = 0
    dropped: int = 0  # a side longer than max_length

    def line(self) -> str:
        return f"{self.pairs} reward pairs; {self.dropped} dropped (a side longer than max_length)"


def reward_sides(record: Record) -> tuple[Any, Any]:
    """(prompt + chosen, prompt + rejected) of one row, checked: strings, or message lists."""
    f, where = record.fields, record.where
    missing = [k for k in ("chosen", "rejected") if k not in f or f[k] is None]
    if missing:
        have = ", ".join(sorted(f)) or "none"
        raise KilnError(f"{where}: a reward-model row needs both sides, 'chosen' and 'rejected'; missing "
                        f"{' and '.join(repr(k) for k in missing)} (fields here: {have})")
    chosen, rejected, prompt = f["chosen"], f["rejected"], f.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is not None and not isinstance(prompt, str):
            raise KilnError(f"{where}: 'chosen' and 'rejected' are strings, so 'prompt' must be a string too "
                            f"(got {type(prompt).__name__})")
        return (prompt or "") + chosen, (prompt or "") + rejected
    chosen = _check_messages(chosen, "chosen", where)
    rejected = _check_messages(rejected, "rejected", where)
    head = _check_messages(prompt, "prompt", where) if prompt is not None else []
    return head + chosen, head + rejected


def side_ids(tokenizer: Tokenizer, side: Any, where: str, template: Any = None) -> list[int]:
    """The token ids of one scored text as TRL's RewardTrainer makes them: a string with the EOS text appended
    (unless it ends with it) and the tokenizer's special tokens; a conversation through the chat template, no
    generation prompt, no special tokens added (`template`: the tokenizer's chat template, when made already)."""
    if isinstance(side, str):
        eos = tokenizer.specials.get("eos_token")
        if eos is None:
            raise KilnError(f"{where}: standard (string) rows get the EOS token appended, as TRL does, "
                            "but the tokenizer names no eos_token")
        return list(tokenizer.backend.encode(side if side.endswith(eos) else side + eos, add_special_tokens=True).ids)
    text = (template or tokenizer.chat()).render(side, add_generation_prompt=False)
    return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)


def _margin(record: Record, with_margin: bool) -> float | None:
    value = record.fields.get("margin")
    if with_margin != (value is not None):
        raise KilnError(f"{record.where}: 'margin' must be given on every row or on none (the first row "
                        f"{'has' if with_margin else 'has none'})")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KilnError(f"{record.where}: 'margin' must be a number, got {value!r}")
    return float(value)


def encode_reward_pairs(records: list[Record], tokenizer: Tokenizer, max_length: int) -> tuple[list[Example], RewardStats]:
    """Examples (chosen_ids, chosen_len, rejected_ids, rejected_len, index[, margin]) and what happened; every
    row is checked before any is tokenized, so a bad row is named before work starts."""
    if max_length < 2:
        raise KilnError(f"data.max_length must be at least 2, got {max_length}")
    sides = [reward_sides(r) for r in records]
    with_margin = bool(records) and records[0].fields.get("margin") is not None
    margins = [_margin(r, with_margin) for r in records]
    stats = RewardStats()
    out: list[Example] = []
    template = tokenizer.chat() if any(not isinstance(c, str) for c, _ in sides) else None
    for r, (chosen, rejected), margin in zip(records, sides, margins):
        seqs = [side_ids(tokenizer, side, r.where, template) for side in (chosen, rejected)]
        if any(len(s) > max_length for s in seqs):
            stats.dropped += 1
            continue
        if any(not s for s in seqs):
            raise KilnError(f"{r.where}: a side is empty once tokenized")
        example: Example = {}
        for name, seq in zip(("chosen", "rejected"), seqs):
            example[f"{name}_ids"] = torch.tensor(seq, dtype=torch.long)
            example[f"{name}_len"] = torch.tensor(len(seq), dtype=torch.long)
        if margin is not None:
            example["margin"] = torch.tensor(margin, dtype=torch.float32)
        example["index"] = torch.tensor(len(out), dtype=torch.long)
        out.append(example)
        stats.pairs += 1
    return out, stats
