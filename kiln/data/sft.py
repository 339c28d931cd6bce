"""Supervised fine-tuning data: chat JSONL -> token ids with loss labels, truncated and optionally packed.

A line holds `messages` ([{role, content}, ...]) or `prompt` / `response` (plus an optional
`system`), and may hold `tools` (OpenAI function schemas). Assistant messages may carry
`tool_calls` ([{"type": "function", "function": {"name", "arguments"}}], arguments an object or a
JSON string) and `reasoning_content`; `{"role": "tool"}` messages hold tool results. The conversation
is rendered with the tokenizer's chat template exactly as transformers'
`apply_chat_template(messages, tools=tools)` renders it, and tokenized without added special tokens.

Labels are IGNORE_INDEX except on assistant turns: each turn's reasoning, text and tool calls and its
closing end-of-turn token (the EOS); never the system/tools block, user turns or tool results.
A tool row (one with `tools`, tool calls or tool results) is encoded turn by turn by kiln.data.turns, the
path multi-turn GRPO rollouts append their tokens with, so SFT and the rollout give one conversation the same
tokens and the same mask. Where the template re-renders history (Qwen3 drops the reasoning of earlier turns
once a new user query comes), the turn-by-turn text is not transformers' rendering: such rows, and rows
without tools, are rendered whole as transformers renders them and each turn is found by rendering the
conversation up to it (or, where that is not a prefix, at the generation-prompt header). `train_on="assistant_no_reasoning"`
also leaves out each turn's reasoning text; `train_on="all"` puts loss everywhere.

Packing concatenates samples into rows of at most `max_length` tokens; each sample's positions
restart at 0 (the model keeps attention inside a sample from that) and its first label is
IGNORE_INDEX, so a packed row gives every sample the loss it has alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kiln.constants import IGNORE_INDEX
from kiln.data.records import Record
from kiln.data.sft_images import ImageTokens, encode_image_record, expand_images, flatten_parts
from kiln.data.turns import REASONING_KEYS, TurnCodec, TurnError
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


TrainOn = Literal["assistant", "assistant_no_reasoning", "all"]


def _check_tool_calls(calls: Any, where: str, at: str) -> None:
    if not isinstance(calls, list):
        raise KilnError(f"{where}: {at}.tool_calls must be a list of {{type, function: {{name, arguments}}}} objects")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None  # {"name", "arguments"} flat is accepted too
        here = f"{at}.tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
            raise KilnError(f"{where}: {here} must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                            f"\"arguments\": object or JSON string}}}}")
        args = fn["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise KilnError(f"{where}: {here}.function.arguments is not JSON ({e.msg} at character {e.pos}): "
                                f"{fn['arguments'][:80]!r}") from None
        if not isinstance(args, dict):
            raise KilnError(f"{where}: {here}.function.arguments must be a JSON object, got {type(args).__name__}")


def _check_message(m: Any, i: int, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise KilnError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    calls = m.get("tool_calls")
    # an assistant turn that only calls tools may have no content (OpenAI writes null)
    if isinstance(m.get("content"), list):
        raise KilnError(f"{where}: messages[{i}].content is a list of parts (images?): image parts need an "
                        "image-text model (one with a vision tower); text-only models read string content")
    if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and calls and m.get("content") is None):
        raise KilnError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'"
                        " (content null only in an assistant turn with tool_calls)")
    if calls is not None:
        if m["role"] != "assistant":
            raise KilnError(f"{where}: messages[{i}] has tool_calls but role {m['role']!r}; only assistant turns call tools")
        _check_tool_calls(calls, where, f"messages[{i}]")
    for key in REASONING_KEYS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise KilnError(f"{where}: messages[{i}].{key} must be a string")
    return dict(m)  # every key goes to the template, as transformers passes them


def conversation(record: Record) -> list[dict[str, Any]]:
    """The messages of one JSONL record, checked; errors name file:line."""
    f = record.fields
    if "messages" in f:
        msgs = f["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise KilnError(f"{record.where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return [_check_message(m, i, record.where) for i, m in enumerate(msgs)]
    if "prompt" in f and "response" in f:
        for key in ("prompt", "response") + (("system",) if f.get("system") is not None else ()):
            if not isinstance(f[key], str):  # never the text "None" as a reply to learn
                raise KilnError(f"{record.where}: field {key!r} must be a string, got "
                                f"{'null' if f[key] is None else type(f[key]).__name__}")
        msgs = [{"role": "system", "content": f["system"]}] if f.get("system") else []
        return msgs + [{"role": "user", "content": f["prompt"]}, {"role": "assistant", "content": f["response"]}]
    have = ", ".join(sorted(f)) or "none"
    raise KilnError(f"{record.where}: needs 'messages' or 'prompt' and 'response' (fields here: {have})")


def record_tools(record: Record) -> list[dict[str, Any]] | None:
    """The record's `tools` (OpenAI function schemas), checked, or None."""
    tools = record.fields.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise KilnError(f"{record.where}: 'tools' must be a list of function schemas "
                        "({\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}})")
    for k, t in enumerate(tools):
        fn = t.get("function", t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise KilnError(f"{record.where}: tools[{k}] has no function name (want {{\"type\": \"function\", "
                            "\"function\": {\"name\": ...}})")
    return tools


def _reply_end(text: str, start: int, stop: int, eos: str | None) -> int:
    """End of the reply that starts at `start`: through the first EOS before `stop`, else the text's end there."""
    at = text.find(eos, start, stop) if eos else -1
    if eos and at >= 0:
        return at + len(eos)
    return start + len(text[start:stop].rstrip())


def _incremental_spans(template: ChatTemplate, messages: list[dict[str, Any]], text: str, eos: str | None,
                       tools: list[dict[str, Any]] | None) -> list[tuple[int, int]] | None:
    """Spans from renderings of each prefix, or None where a prefix is not a prefix of the whole."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, tools=tools)
        upto = template.render(messages[: i + 1], tools=tools)
        if not (text.startswith(upto) and upto.startswith(before)):
            return None
        # the last EOS in the reply: what follows it (a newline) is not the reply
        reply = upto[len(before):]
        end = reply.rfind(eos) + len(eos) if eos and eos in reply else len(reply.rstrip())
        spans.append((len(before), len(before) + end))
    return spans


def _header_spans(template: ChatTemplate, messages: list[dict[str, Any]], text: str, eos: str | None,
                  tools: list[dict[str, Any]] | None) -> list[tuple[int, int]] | None:
    """Spans after each occurrence of the generation-prompt header in the whole rendering (one per assistant
    turn, in order), each through its first EOS; None when the header is not found once per turn."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    with_prompt = template.render(messages[:first], add_generation_prompt=True, tools=tools)
    without = template.render(messages[:first], tools=tools)
    header = with_prompt[len(without):]
    if not with_prompt.startswith(without) or not header.strip():
        return None
    starts, at = [], text.find(header)
    while at >= 0:
        starts.append(at + len(header))
        at = text.find(header, at + len(header))
    if len(starts) != sum(m["role"] == "assistant" for m in messages):
        return None
    stops = [s - len(header) for s in starts[1:]] + [len(text)]
    return [(s, _reply_end(text, s, stop, eos)) for s, stop in zip(starts, stops)]


def assistant_spans(template: ChatTemplate, messages: list[dict[str, Any]], eos: str | None, where: str,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of each assistant turn (up to and including its EOS)."""
    text = template.render(messages, tools=tools, where=where)  # a refusal names the data row  # sweep
    if not any(m["role"] == "assistant" for m in messages):
        return text, []
    spans = _incremental_spans(template, messages, text, eos, tools)
    if spans is None:
        spans = _header_spans(template, messages, text, eos, tools)
    if spans is None:
        raise KilnError(f"{where}: the chat template does not render this conversation incrementally (a prefix "
                        "changes when messages are added) and its assistant header does not occur once per "
                        "assistant turn, so assistant tokens cannot be located")
    return text, spans


def _reasoning_spans(text: str, messages: list[dict[str, Any]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where each assistant turn's reasoning text sits inside its span (templates may drop it: then nowhere)."""
    out = []
    turns = [m for m in messages if m["role"] == "assistant"]
    for m, (start, end) in zip(turns, spans):
        reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str)), "").strip()
        at = text.find(reasoning, start, end) if reasoning else -1
        if at >= 0:
            out.append((at, at + len(reasoning)))
    return out


def _turn_by_turn(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]],
                  train_on: TrainOn, tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]] | None:
    """A tool row's (input_ids, labels) from kiln.data.turns (the rollout's masking path), or None where the
    template cannot append its turns or re-renders history (the text then differs from the whole rendering)."""
    codec = TurnCodec(tokenizer, template)
    try:
        text, turns = codec.conversation(messages, tools, hide_reasoning=train_on == "assistant_no_reasoning")
    except TurnError:
        return None
    if text != template.render(messages, tools=tools):
        return None
    return turns.ids, [i if m else IGNORE_INDEX for i, m in zip(turns.ids, turns.mask)]


def encode_conversation(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]],
                        train_on: TrainOn = "assistant", where: str = "",
                        tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one conversation, untruncated."""
    eos = tokenizer.specials.get("eos_token")
    tool_row = tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if tool_row and train_on in ("assistant", "assistant_no_reasoning"):
        got = _turn_by_turn(tokenizer, template, messages, train_on, tools)
        if got is not None:
            return got
    text, spans = assistant_spans(template, messages, eos, where, tools)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    ids = list(enc.ids)
    if train_on == "all":
        return ids, list(ids)
    if train_on not in ("assistant", "assistant_no_reasoning"):
        raise KilnError(f"train_on must be 'assistant', 'assistant_no_reasoning' or 'all', got {train_on!r}")
    hidden = _reasoning_spans(text, messages, spans) if train_on == "assistant_no_reasoning" else []
    labels = [IGNORE_INDEX] * len(ids)
    for t, (start, end) in enumerate(enc.offsets):
        mid = (start + end - 1) // 2 if end > start else start
        if any(a <= mid < b for a, b in spans) and not any(a <= mid < b for a, b in hidden):
            labels[t] = ids[t]
    return ids, labels


def encode_sft(records: list[Record], tokenizer: Tokenizer, max_length: int, train_on: TrainOn = "assistant",
               pack: bool = False, images: ImageTokens | None = None) -> tuple[list[Example], SFTStats]:
    """Examples for the Trainer (input_ids, labels, and position_ids when packed) and what happened. With
    `images` (an image-text model's), messages may hold image parts (kiln.data.sft_images) and every example
    carries its pixel_values and image_grid_thw."""
    if max_length < 2:
        raise KilnError(f"data.max_length must be at least 2, got {max_length}")
    template = tokenizer.chat()
    stats = SFTStats()
    samples: list[tuple[list[int], list[int]]] = []
    pixels: list[dict[str, torch.Tensor]] = []

    def encode(r: Record) -> tuple[list[int], list[int]]:
        return encode_conversation(tokenizer, template, conversation(r), train_on, r.where, record_tools(r))

    for r in records:
        if images is not None:
            ids, labels, inputs, cut = encode_image_record(r, images, encode, max_length)
            pixels.append(inputs)
        else:
            ids, labels = encode(r)
            cut = len(ids) > max_length
            ids, labels = ids[:max_length], labels[:max_length]
        stats.truncated += cut
        samples.append((ids, labels))
        stats.samples += 1
        stats.tokens += len(ids)
        stats.loss_tokens += sum(1 for x in labels[1:] if x != IGNORE_INDEX)  # the first token is never a target
    if pack:
        examples = pack_samples(samples, max_length, pixels or None)
    else:
        examples = [{"input_ids": torch.tensor(i, dtype=torch.long), "labels": torch.tensor(lab, dtype=torch.long),
                     **(pixels[n] if pixels else {})} for n, (i, lab) in enumerate(samples)]
    stats.rows = len(examples)
    return examples, stats


def pack_samples(samples: list[tuple[list[int], list[int]]], max_length: int,
                 extras: list[dict[str, torch.Tensor]] | None = None) -> list[Example]:
    """Greedy in order: a row takes samples while they fit. Positions restart per sample. `extras` (one dict
    per sample: its images' tensors) are concatenated along dim 0 in the row's sample order."""
    rows: list[Example] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    extra: list[dict[str, torch.Tensor]] = []

    def flush() -> None:
        if ids:
            row = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(pos)}
            if extras is not None:
                row.update({k: torch.cat([e[k] for e in extra]) for k in extra[0]})
            rows.append(row)
            ids.clear()
            labels.clear()
            pos.clear()
            extra.clear()

    for n, (s_ids, s_labels) in enumerate(samples):
        if len(ids) + len(s_ids) > max_length:
            flush()
        ids.extend(s_ids)
        labels.extend([IGNORE_INDEX] + s_labels[1:])  # nothing predicts a sample's first token from the one before
        pos.extend(range(len(s_ids)))
        if extras is not None:
            extra.append(extras[n])
    flush()
    return rows


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation followed by the assistant generation prompt (for chat and generation)."""
    text = tokenizer.chat().render(messages, add_generation_prompt=True, tools=tools)
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def image_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], images: ImageTokens,
                      tools: list[dict[str, Any]] | None = None) -> tuple[list[int], dict[str, torch.Tensor]]:
    """An image-text model's prompt: the conversation (image parts allowed) with the generation prompt, each
    image's placeholder expanded to its patch count, and the images' pixel inputs (`prompt_inputs` of generate)."""
    flat, paths = flatten_parts(messages, images, "chat")
    for i, m in enumerate(flat):
        _check_message(m, i, "chat")
    ids = chat_prompt_ids(tokenizer, flat, tools)
    ids, _, inputs = expand_images(ids, list(ids), paths, images, "chat")
    return ids, inputs
