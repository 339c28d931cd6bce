"""Chat messages and tool calls between OpenAI's wire form and the model's chat template.

In: OpenAI messages (tool-call arguments as JSON strings, `developer` as a system turn, text parts) become the
messages the template renders (arguments as objects, as transformers' templates want them); `tools` go to the template
as given. Out: the model's `<tool_call>{"name", "arguments"}</tool_call>` blocks (kiln.hub.chat.split_tool_calls) become
OpenAI `tool_calls` with ids and JSON-string arguments. A stream holds back text from the first `<tool_call>` on, so
a client never sees the markup; the calls go out when the completion ends.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kiln.hub.chat import split_tool_calls
from kiln.serve.protocol import ContentPart, Message, RequestError

CALL_OPEN = "<tool_call>"


def template_messages(messages: list[Message], image_text: str | None = None) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them, each image part written as `image_text` (the
    model's vision tokens: kiln.serve.images); a tool call whose arguments are not a JSON object is a RequestError
    naming it."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text if isinstance(part, ContentPart) else image_text or "" for part in content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise RequestError(f"{param}: not JSON ({e})", param) from None
                if not isinstance(args, dict):
                    raise RequestError(f"{param}: want a JSON object, got {type(args).__name__}", param)
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed calls ({"name", "arguments"}) in OpenAI's form: an id each, arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                          else json.dumps(c["arguments"], ensure_ascii=False)}} for c in calls]


def reply(text: str, tools_offered: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished completion. Without tools offered the text is the content as generated.
    With tool calls found the rest of the text, stripped, is the content (None when empty, as OpenAI sends it)."""
    if not tools_offered:
        return text, []
    content, calls = split_tool_calls(text)
    if not calls:
        return text, []
    content = content.strip()
    return content or None, openai_tool_calls(calls)


class StreamFilter:
    """A completion's text deltas as a stream may show them when tools were offered: everything before the first
    `<tool_call>` passes (less a tail that could be the start of one, held until it cannot); the rest is kept for
    `finish`, which parses it into calls (or, when it holds none, lets it out as text)."""

    def __init__(self, tools_offered: bool):
        self.active = tools_offered
        self.pending = ""    # held back: a possible start of CALL_OPEN, or everything after it
        self.calling = False  # CALL_OPEN was seen

    def push(self, delta: str) -> str:
        if not self.active:
            return delta
        self.pending += delta
        if self.calling:
            return ""
        at = self.pending.find(CALL_OPEN)
        if at >= 0:
            self.calling = True
            shown, self.pending = self.pending[:at], self.pending[at:]
            return shown
        keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.pending)), 0, -1)
                     if self.pending.endswith(CALL_OPEN[:k])), 0)
        shown = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(shown):]
        return shown

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(text still to show, tool calls in OpenAI's form) at the end of the completion."""
        rest, self.pending = self.pending, ""
        if not self.active or not rest:
            return rest, []
        content, calls = split_tool_calls(rest)
        if not calls:
            return rest, []
        return content.strip(), openai_tool_calls(calls)
