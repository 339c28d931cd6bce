"""`kiln chat`: talk to a model turn by turn through its chat template, with tools and, for an image-text
model, images shown at the start (--image) or between turns (a `/image PATH` line)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import typer

from kiln.cli.common import ALLOW_MISSING, ALLOW_UNUSED
from kiln.cli.llm import SEED, TEMPERATURE, TOP_K, TOP_P, _load, _sampling
from kiln.cli.output import out
from kiln.errors import KilnError

IMAGE_COMMAND = "/image"


def _not_text(line: str) -> str | None:
    """Why a typed line cannot go to the tokenizer (None: it can): bytes that are not UTF-8 reach it as lone
    surrogates, which the tokenizer refuses with a TypeError."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = line[e.start].encode("utf-8", "surrogateescape")
        return (f"that line is not UTF-8 text (byte 0x{byte.hex()} at column {e.start + 1}); nothing was sent, "
                "type it again")
    return None


def _read_tools(path: Path | None) -> list | None:
    """The --tools file: a JSON list of OpenAI function schemas."""
    if path is None:
        return None
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise KilnError(f"--tools {path}: cannot read a JSON list of function schemas ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise KilnError(f"--tools {path}: want a JSON list of function schemas "
                        '([{"type": "function", "function": {"name", "description", "parameters"}}, ...])')
    return tools


def show_reply(message: dict) -> list[str]:
    """How an assistant message is shown: its reasoning, each tool call as name(arguments), then its text."""
    lines = [f"think> {message['reasoning_content']}"] if message.get("reasoning_content") else []
    for call in message.get("tool_calls", []):
        fn = call["function"]
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
        lines.append(f"call> {fn['name']}({args})")
    if message["content"] or not message.get("tool_calls"):
        lines.append(f"bot> {message['content']}")
    return lines


def image_error(model, model_dir: Path, path: Path, where: str) -> str | None:
    """Why `path` cannot be shown to the model (None when it can): a missing file, or a model without a tower."""
    if not path.is_file():
        return f"{where}: image file {path} does not exist"
    if not getattr(model, "takes_images", False):
        return (f"{where}: {model_dir} has no vision tower (model_type {model.config.model_type!r}); "
                "it takes no images")
    return None


def chat(model_dir: Path = typer.Argument(..., help="An HF causal-LM directory with a chat template."),
         system: str | None = typer.Option(None, "--system", help="A system message."),
         tools_file: Path | None = typer.Option(None, "--tools", help="A JSON list of function schemas the "
                                                   "template offers the model; its calls are shown as call> lines "
                                                   "and the next line you type is their result."),
         max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
         temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P,
         seed: int | None = SEED,
         image: list[Path] | None = typer.Option(None, "--image", help="An image shown with the first message "
                                                    "(image-text models; repeatable)."),
         allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED) -> None:
    """Talk to the model turn by turn through its chat template. An empty line or Ctrl-D ends.
    --image puts images before the first message's text; a line `/image PATH` between turns puts one before
    the next message's text (image-text models; the directory's image processor reads them).

    Replies show reasoning (think>), tool calls (call> name(arguments)) and text (bot>); after a tool
    call the prompt is tool> and the line typed is the tool's result."""
    from kiln.data.sft import chat_prompt_ids, image_chat_prompt
    from kiln.engine.continuer import Continuer
    from kiln.hub.chat import parse_reply

    _sampling(max_new_tokens, temperature, top_k, top_p, seed)  # every flag checked before the model loads
    tools = _read_tools(tools_file)
    for path in image or []:
        if not path.is_file():
            raise KilnError(f"--image: image file {path} does not exist")
    model = _load(model_dir, allow_missing, allow_unused)
    model.tokenizer.chat()  # fail now, not after the first question, if there is no template
    # turns run on kiln.engine where it runs the family (a turn's prompt starts with the last one's, so the cache
    # holds most of it already; an image-text model's images, re-sent each turn, go through the vision tower once);
    # other families on the model's generate loop
    continue_ = Continuer(model, max_new_tokens, temperature, top_k, top_p, seed, max_seqs=1)
    for path in image or []:
        if (error := image_error(model, model_dir, path, "--image")) is not None:
            raise KilnError(error)
    spec = None  # the model's image tokens and processor, from the first image on
    pending = [{"type": "image", "image": str(p.resolve())} for p in image or []]  # for the next user message
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []  # chat messages
    calling = False  # the last reply called tools: the next line is their result
    with contextlib.suppress(AttributeError, ValueError):  # bytes that are not UTF-8 arrive, to be named, not raised
        sys.stdin.reconfigure(errors="surrogateescape")  # type: ignore[union-attr]
    while True:
        try:
            line = input("tool> " if calling else "you> ")
        except EOFError:
            break
        if not line.strip():
            break
        if (error := _not_text(line)) is not None:  # a slip (a pasted binary, a Latin-1 terminal): told, goes on
            out.print(f"error: {error}")
            continue
        if line.split(maxsplit=1)[0] == IMAGE_COMMAND:  # an interactive slip is told, and the chat goes on
            arg = line.strip()[len(IMAGE_COMMAND):].strip()
            path = Path(arg)
            error = (image_error(model, model_dir, path, IMAGE_COMMAND) if arg else
                     f"{IMAGE_COMMAND}: name an image file: {IMAGE_COMMAND} PATH")
            if error is not None:
                out.print(f"error: {error}")
            else:
                pending.append({"type": "image", "image": str(path.resolve())})
                out.print(f"(image {path} goes with your next message)")
            continue
        content = pending + [{"type": "text", "text": line}] if pending and not calling else line
        pending = pending if calling else []  # images go with a message typed, not with a tool's result
        messages.append({"role": "tool" if calling else "user", "content": content})
        if spec is None and any(isinstance(m["content"], list) for m in messages):
            spec = model.image_tokens(model_dir=model_dir)
        if spec is not None:  # the whole conversation, its images with it, each turn
            prompt, inputs = image_chat_prompt(model.tokenizer, messages, spec, tools)
            new = continue_(list(prompt), inputs)
        else:
            new = continue_(list(chat_prompt_ids(model.tokenizer, messages, tools)))
        reply = parse_reply(model.tokenizer.decode(new))
        for shown in show_reply(reply):
            out.print(shown)
        messages.append(reply)
        calling = bool(reply.get("tool_calls"))


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
