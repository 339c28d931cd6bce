"""Chat templates from tokenizer_config.json, rendered with jinja2 the way transformers renders them.

Same environment as `apply_chat_template`: a sandbox with trim_blocks and lstrip_blocks, loop
controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`; the template
sees `messages`, `tools`, `add_generation_prompt` and the named special tokens (bos_token,
eos_token, ...) as strings. As in transformers, a message's reasoning is offered under all three of
its names (`reasoning_content`, `thinking`, `reasoning`), whichever the template reads. A `{% generation %}` block renders its body (kiln finds assistant spans itself).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError

# A ChatML-style template (the layout Qwen uses): <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ '; this template knows system, user, assistant') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask marker; rendered as its body."""
    tags = {"generation"}  # noqa: RUF012 - jinja2 declares Extension.tags a plain set attribute; ClassVar may not override it

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning (under any of its names) also as `thinking` and `reasoning_content`."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    def __init__(self, template: str, specials: dict[str, str] | None = None, source: str = "chat template"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        try:
            self.template = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise KilnError(f"{source}: chat template line {e.lineno}: {e.message}") from None
        self.specials = dict(specials or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None, where: str = "", **extra: Any) -> str:
        """The conversation as the template writes it; `where` (a data file's `path:line`) leads a refusal, so
        an unknown role or a template's own raise_exception names the row as well as the template."""
        messages = [_alias_reasoning(m) for m in messages]
        try:
            return self.template.render(messages=messages, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **{**self.specials, **extra})
        except jinja2.exceptions.TemplateError as e:
            lead = f"{where}: " if where else ""
            raise KilnError(f"{lead}{self.source}: {e.message or e}") from None


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The text with each `<tool_call>{"name", "arguments"}</tool_call>` block taken out, and those calls as
    `{"name", "arguments"}` in order (Hermes/Qwen layout). A block that is not such JSON stays in the text as
    written (shown, not lost). The text is returned unchanged when it holds no call."""
    calls, kept, at = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    kept.append(text[at:])
    return "".join(kept), calls


def parse_reply(text: str) -> dict[str, Any]:
    """An assistant message from generated text in the Hermes/Qwen layout: a leading `<think>...</think>` as
    `reasoning_content`, each `<tool_call>{"name", "arguments"}</tool_call>` as a tool call, the rest as
    `content` (split_tool_calls)."""
    message: dict[str, Any] = {"role": "assistant"}
    think = _THINK.match(text)
    if think:
        message["reasoning_content"] = think.group(1).strip()
        text = text[think.end():]
    content, calls = split_tool_calls(text)
    message["content"] = content.strip()
    if calls:
        message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return message
