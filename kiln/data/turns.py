"""A conversation as tokens, turn by turn: the one masking path of SFT tool rows and multi-turn rollouts.

The opening (every message before the first assistant turn) is rendered once with the generation prompt; each
assistant turn adds its own tokens (loss mask 1) through its end-of-turn token; what follows a turn (tool
results, user messages, the next generation prompt: loss mask 0) is the difference of two renderings of a short
conversation, the assistant message alone and then it with the new messages, cut after the end-of-turn token.
History is never rendered again, so a conversation grows only by appending tokens: what a rollout samples is
what the trainer sees, and SFT on the same conversation gives the same tokens and the same mask.

An assistant turn's tokens are, in a rollout, the sampled ones; in SFT, the template's rendering of that turn
(`TurnCodec.assistant_text`, the turn after a one-message stand-in history, so no earlier turn is rendered
again) tokenized on its own, as the policy writes it after the generation prompt.

Where SFT and a rollout still differ: (1) a rollout's turn is the tokens it sampled, which may split the same
text otherwise than the tokenizer does (SFT's are the tokenizer's); (2) an SFT row ends as the template ends a
conversation (after the last end-of-turn, mask 0), a rollout at the end-of-turn token; (3) a template that
re-renders history (Qwen3 drops earlier turns' reasoning after a new user query) or is not prefix-preserving is
refused by rollouts at startup, while SFT encodes such a row whole, as transformers renders it (kiln.data.sft),
since that is the text the row's model is served with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError
from kiln.hub import ChatTemplate, Tokenizer

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the names transformers aliases to each other
_STAND_IN = {"role": "user", "content": "kiln"}  # the history a turn is rendered after (never the real one)


class TurnError(KilnError):
    """The template cannot append turns as tokens (it re-renders, or a turn does not end on end-of-turn)."""


@dataclass
class Turns:
    """Token ids being built and their loss mask (1: the assistant's tokens, 0: everything else). The lists are
    extended in place, so a Turns over a caller's lists (a rollout's episode) appends to them."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def assistant(self, toks: list[int], mask: list[int] | None = None) -> None:
        self.ids.extend(toks)
        self.mask.extend([1] * len(toks) if mask is None else mask)

    def other(self, toks: list[int]) -> None:
        self.ids.extend(toks)
        self.mask.extend([0] * len(toks))


class TurnCodec:
    """A tokenizer's chat template, used to render conversations turn by turn. `eos_texts`: the end-of-turn
    token texts (default: the tokenizer's EOS)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None,
                 eos_texts: list[str] | None = None):
        self.tokenizer = tokenizer
        self.template = template or tokenizer.chat()
        eos = tokenizer.specials.get("eos_token")
        self.eos_texts = list(eos_texts) if eos_texts is not None else ([eos] if eos else [])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.backend.encode(text, add_special_tokens=False).ids)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return self.template.render(messages, add_generation_prompt=generation, tools=tools or None)

    def _cut(self, text: str) -> int:
        """Just after the last end-of-turn token in `text` (-1: none)."""
        return max((text.rfind(t) + len(t) for t in self.eos_texts if t in text), default=-1)

    def opening(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The conversation before the first assistant turn, with the generation prompt."""
        return self.encode(self.render(messages, tools, True))

    def assistant_text(self, message: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
        """The template's text of one assistant turn, from after the generation prompt through end-of-turn."""
        before = self.render([_STAND_IN], tools, True)
        after = self.render([_STAND_IN, message], tools, False)
        cut = self._cut(after[len(before):])
        if not after.startswith(before) or cut < 0:
            raise TurnError("the chat template's assistant turn does not follow its generation prompt and end with "
                            f"the end-of-turn token ({', '.join(self.eos_texts) or 'the tokenizer has no EOS'})")
        return after[len(before): len(before) + cut]

    def between_text(self, assistant: dict[str, Any], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, generation: bool = True) -> str:
        """The text between the end of an assistant turn and the next one: `new` messages (and the generation
        prompt), as render(stand-in, assistant, *new) less render(stand-in, assistant) cut after end-of-turn."""
        # reasoning kept: a template may render a turn's reasoning block only when it has one (Qwen3)
        bare = {k: v for k, v in assistant.items() if k in ("role", "content", "tool_calls", *REASONING_KEYS)}
        base = [_STAND_IN, bare]
        before = self.render(base, tools, False)
        cut = self._cut(before)
        if cut < 0:
            raise TurnError("the chat template's assistant turn does not end with the end-of-turn token "
                            f"({', '.join(self.eos_texts) or 'the tokenizer has no EOS'})")
        after = self.render(base + new, tools, generation)
        if not after.startswith(before[:cut]):
            roles = "/".join(sorted({m["role"] for m in new}))
            raise TurnError(f"the chat template is not prefix-preserving when a {roles} message follows an "
                            "assistant turn (it re-renders the conversation), so turns cannot be appended as tokens")
        return after[cut:]

    def between(self, assistant: dict[str, Any], new: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, generation: bool = True) -> list[int]:
        return self.encode(self.between_text(assistant, new, tools, generation))

    def assistant_ids(self, message: dict[str, Any], tools: list[dict[str, Any]] | None,
                      hide_reasoning: bool = False) -> tuple[str, list[int], list[int]]:
        """(text, ids, mask) of one assistant turn; `hide_reasoning`: mask 0 on the turn's reasoning text."""
        text = self.assistant_text(message, tools)
        enc = self.tokenizer.backend.encode(text, add_special_tokens=False)
        reasoning = next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str)), "").strip()
        at = text.find(reasoning) if hide_reasoning and reasoning else -1
        mask = []
        for start, end in enc.offsets:
            mid = (start + end - 1) // 2 if end > start else start
            mask.append(0 if at >= 0 and at <= mid < at + len(reasoning) else 1)
        return text, list(enc.ids), mask

    def conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     hide_reasoning: bool = False) -> tuple[str, Turns]:
        """A whole conversation turn by turn: (its text, its ids and mask). Messages after the last assistant
        turn are appended without a generation prompt."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise TurnError("a conversation rendered turn by turn needs messages before its first assistant turn")
        text = self.render(messages[:first], tools, True)
        out = Turns()
        out.other(self.encode(text))
        i = first
        while i < len(messages):
            turn, ids, mask = self.assistant_ids(messages[i], tools, hide_reasoning)
            out.assistant(ids, mask)
            j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
            tail = self.between_text(messages[i], messages[i + 1: j], tools, generation=j < len(messages))
            out.other(self.encode(tail))
            text += turn + tail
            i = j
        return text, out
