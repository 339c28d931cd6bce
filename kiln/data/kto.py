"""Unpaired preference rows for KTO: `{"prompt", "completion", "label"}` -> prompt and completion token ids,
tokenized as TRL 1.16's KTOTrainer.

`label` is true for a desirable completion, false for an undesirable one (a JSON bool, or 0 / 1). `prompt` and
`completion` are both strings (standard) or both message lists (conversational). As TRL does:
- standard: the EOS text appended to the completion unless it ends with it; `prompt` and `prompt + completion`
  tokenized as text with the tokenizer's special tokens;
- conversational: the prompt rendered with the generation prompt, `prompt + completion` rendered whole, both
  without special tokens;
- the completion starts where the two token lists first differ; a row whose prompt alone fills `max_length`
  is dropped (the batch keeps the start of each longer sequence).
Every row is checked before any is tokenized, so a row without a label is named before work starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.data.preference import _check_messages, _prefix
from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub import Tokenizer

Example = dict[str, torch.Tensor]
__all__ = ["UnpairedStats", "encode_unpaired", "unpaired_row"]


@dataclass
class UnpairedStats:
    rows: int = 0
    desirable: int = 0
    dropped: int = 0      # prompt alone fills max_length
    prompt_cut: int = 0   # rows whose tokenized prompt is not a prefix of prompt + completion

    def line(self) -> str:
        return (f"{self.rows} rows ({self.desirable} desirable, {self.rows - self.desirable} undesirable); "
                f"{self.dropped} dropped (prompt fills max_length), {self.prompt_cut} prompts cut where the tokens "
                "diverge")


def unpaired_row(record: Record) -> tuple[Any, Any, bool]:
    """(prompt, completion, label) of one row, checked."""
    f, where = record.fields, record.where
    missing = [k for k in ("prompt", "completion", "label") if f.get(k) is None]
    if missing:
        have = ", ".join(sorted(f)) or "none"
        hint = (" (a paired row: KTO reads one completion per row with its label, TRL's unpaired format)"
                if "chosen" in f or "rejected" in f else "")
        raise KilnError(f"{where}: a KTO row needs 'prompt', 'completion' and 'label' (true: desirable, false: "
                        f"undesirable); missing {' and '.join(repr(k) for k in missing)} (fields here: {have}){hint}")
    label = f["label"]
    if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
        label = bool(label)
    else:
        raise KilnError(f"{where}: 'label' must be true or false (or 1 / 0), got {label!r}")
    prompt, completion = f["prompt"], f["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion, label
    if isinstance(prompt, str) or isinstance(completion, str):
        raise KilnError(f"{where}: 'prompt' and 'completion' must both be strings or both message lists")
    return _check_messages(prompt, "prompt", where), _check_messages(completion, "completion", where), label


def encode_unpaired(records: list[Record], tokenizer: Tokenizer, max_length: int) -> tuple[list[Example], UnpairedStats]:
    """Examples (prompt_ids, completion_ids, their lengths, label, index) and what happened."""
    if max_length < 2:
        raise KilnError(f"data.max_length must be at least 2, got {max_length}")
    rows = [unpaired_row(r) for r in records]
    eos = tokenizer.specials.get("eos_token")
    template = tokenizer.chat() if any(not isinstance(p, str) for p, _, _ in rows) else None
    stats = UnpairedStats()
    out: list[Example] = []
    for r, (prompt, completion, label) in zip(records, rows):
        if isinstance(prompt, str):
            if eos is None:
                raise KilnError(f"{r.where}: standard (string) rows get the EOS token appended, as TRL does, "
                                "but the tokenizer names no eos_token")
            completion = completion if completion.endswith(eos) else completion + eos
            p = list(tokenizer.backend.encode(prompt, add_special_tokens=True).ids)
            pc = list(tokenizer.backend.encode(prompt + completion, add_special_tokens=True).ids)
        else:
            assert template is not None  # loaded above: this row is conversational
            p = list(tokenizer.backend.encode(template.render(prompt, add_generation_prompt=True),
                                              add_special_tokens=False).ids)
            pc = list(tokenizer.backend.encode(template.render(prompt + completion), add_special_tokens=False).ids)
        cut = _prefix(p, pc)
        stats.prompt_cut += cut < len(p)
        if cut >= max_length:
            stats.dropped += 1
            continue
        if len(pc) <= cut:
            raise KilnError(f"{r.where}: the completion is empty once tokenized")
        out.append({"prompt_ids": torch.tensor(pc[:cut], dtype=torch.long),
                    "completion_ids": torch.tensor(pc[cut:], dtype=torch.long),
                    "prompt_len": torch.tensor(cut, dtype=torch.long),
                    "completion_len": torch.tensor(len(pc) - cut, dtype=torch.long),
                    "label": torch.tensor(label), "index": torch.tensor(len(out), dtype=torch.long)})
        stats.rows += 1
        stats.desirable += label
    return out, stats
