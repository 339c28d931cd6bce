"""Supervised fine-tuning data: chat JSONL -> token ids with loss labels, truncated and optionally packed.

A line holds `messages` ([{role, content}, ...]) or `prompt` / `response` (plus an optional
`system`). The conversation is rendered with the tokenizer's chat template (as transformers'
`apply_chat_template` renders it) and tokenized without added special tokens. Labels are
IGNORE_INDEX except on assistant replies: each reply's text and its closing end-of-turn token
(the EOS), found by rendering the conversation up to each reply; `train_on="all"` puts loss
everywhere.

Packing concatenates samples into rows of at most `max_length` tokens; each sample's positions
restart at 0 (the model keeps attention inside a sample from that) and its first label is
IGNORE_INDEX, so a packed row gives every sample the loss it has alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kiln.constants import IGNORE_INDEX
from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub import ChatTemplate, Tokenizer

Example = dict[str, torch.Tensor]


@dataclass
class SFTStats:
    samples: int = 0
    truncated: int = 0      # samples cut to max_length
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0

    def line(self) -> str:
        return (f"{self.samples} samples -> {self.rows} rows, {self.tokens} tokens ({self.loss_tokens} with loss); "
                f"{self.truncated} truncated to max_length")


def conversation(record: Record) -> list[dict[str, str]]:
    """The messages of one JSONL record, checked; errors name file:line."""
    f = record.fields
    if "messages" in f:
        msgs = f["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise KilnError(f"{record.where}: 'messages' must be a non-empty list of {{role, content}} objects")
        out = []
        for i, m in enumerate(msgs):
            # content null only where transformers' templates expect it: an assistant turn that calls tools
            calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                    isinstance(m.get("content"), str) or (calls and m.get("content") is None)):
                raise KilnError(f"{record.where}: messages[{i}] must be an object with string 'role' and 'content'"
                                " (content null only in an assistant turn with tool_calls)")
            out.append({"role": m["role"], "content": m["content"],
                        **({"tool_calls": m["tool_calls"]} if calls else {})})
        return out
    if "prompt" in f and "response" in f:
        for key in ("prompt", "response") + (("system",) if f.get("system") is not None else ()):
            if not isinstance(f[key], str):  # never the text "None" as a reply to learn
                raise KilnError(f"{record.where}: field {key!r} must be a string, got "
                                f"{'null' if f[key] is None else type(f[key]).__name__}")
        msgs = [{"role": "system", "content": f["system"]}] if f.get("system") else []
        return msgs + [{"role": "user", "content": f["prompt"]}, {"role": "assistant", "content": f["response"]}]
    have = ", ".join(sorted(f)) or "none"
    raise KilnError(f"{record.where}: needs 'messages' or 'prompt' and 'response' (fields here: {have})")


def assistant_spans(template: ChatTemplate, messages: list[dict[str, str]], eos: str | None,
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of each assistant reply (up to and including its EOS)."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise KilnError(f"{where}: the chat template does not render this conversation incrementally "
                            "(a prefix changes when messages are added), so assistant tokens cannot be located")
        reply = upto[len(before):]
        end = reply.rfind(eos) + len(eos) if eos and eos in reply else len(reply.rstrip())
        spans.append((len(before), len(before) + end))  # what follows the EOS (a newline) is not the reply
    return text, spans


def encode_conversation(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, str]],
                        train_on: Literal["assistant", "all"] = "assistant", where: str = "") -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one conversation, untruncated."""
    eos = tokenizer.specials.get("eos_token")
    text, spans = assistant_spans(template, messages, eos, where)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    ids = list(enc.ids)
    if train_on == "all":
        return ids, list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    for t, (start, end) in enumerate(enc.offsets):
        mid = (start + end - 1) // 2 if end > start else start
        if any(a <= mid < b for a, b in spans):
            labels[t] = ids[t]
    return ids, labels


def encode_sft(records: list[Record], tokenizer: Tokenizer, max_length: int,
               train_on: Literal["assistant", "all"] = "assistant", pack: bool = False) -> tuple[list[Example], SFTStats]:
    """Examples for the Trainer (input_ids, labels, and position_ids when packed) and what happened."""
    if max_length < 2:
        raise KilnError(f"data.max_length must be at least 2, got {max_length}")
    template = tokenizer.chat()
    stats = SFTStats()
    samples: list[tuple[list[int], list[int]]] = []
    for r in records:
        ids, labels = encode_conversation(tokenizer, template, conversation(r), train_on, r.where)
        if len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            stats.truncated += 1
        samples.append((ids, labels))
        stats.samples += 1
        stats.tokens += len(ids)
        stats.loss_tokens += sum(1 for x in labels[1:] if x != IGNORE_INDEX)  # the first token is never a target
    examples = pack_samples(samples, max_length) if pack else [
        {"input_ids": torch.tensor(i, dtype=torch.long), "labels": torch.tensor(lab, dtype=torch.long)}
        for i, lab in samples]
    stats.rows = len(examples)
    return examples, stats


def pack_samples(samples: list[tuple[list[int], list[int]]], max_length: int) -> list[Example]:
    """Greedy in order: a row takes samples while they fit. Positions restart per sample."""
    rows: list[Example] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []

    def flush() -> None:
        if ids:
            rows.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
                         "position_ids": torch.tensor(pos)})
            ids.clear(), labels.clear(), pos.clear()

    for s_ids, s_labels in samples:
        if len(ids) + len(s_ids) > max_length:
            flush()
        ids.extend(s_ids)
        labels.extend([IGNORE_INDEX] + s_labels[1:])  # nothing predicts a sample's first token from the one before
        pos.extend(range(len(s_ids)))
    flush()
    return rows


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation followed by the assistant generation prompt (for chat and generation)."""
    text = tokenizer.chat().render(messages, add_generation_prompt=True)
    return tokenizer.backend.encode(text, add_special_tokens=False).ids
