"""The wire format without a model: request validation names the field, tool calls go between OpenAI's form and the
template's, and a stream holds back tool-call markup (however the text is split into deltas)."""

from __future__ import annotations

import json

import pytest

from kiln.serve import protocol as P
from kiln.serve.tools import StreamFilter, reply, template_messages

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _err(model, body: dict) -> P.RequestError:
    with pytest.raises(P.RequestError) as e:
        P.parse(model, json.dumps(body).encode())
    return e.value


@pytest.mark.parametrize("body,param,words", [
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "Input should be"),
    ({"model": "m", "messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "missing required argument: model"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "less than"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "greater than"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, "top_logprobs", "20"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "greater"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", ""]}, "stop", "empty"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate", "unrecognized"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools.0.function", "missing"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format", "only"),
])
def test_chat_request_errors_name_the_field(body, param, words):
    e = _err(P.ChatRequest, body)
    assert e.status == 400 and e.param == param and words in e.message, (e.param, e.message)
    assert e.body()["error"]["param"] == param and e.body()["error"]["type"] == "invalid_request_error"


def test_completion_request_errors_and_a_good_one():
    assert _err(P.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6}).param == "logprobs"
    assert _err(P.CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"}).param == "suffix"
    assert "not JSON" in _err_raw(b"{nope").message
    req = P.parse(P.CompletionRequest, b'{"model": "m", "prompt": [1, 2], "stop": "x", "user": "u"}')
    assert req.prompt == [1, 2] and req.stops == ("x",) and req.max_tokens == 16


def _err_raw(body: bytes) -> P.RequestError:
    with pytest.raises(P.RequestError) as e:
        P.parse(P.ChatRequest, body)
    return e.value


def test_sse_framing():
    assert P.sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert P.SSE_DONE == b"data: [DONE]\n\n"


def test_tool_calls_in_and_out():
    req = P.parse(P.ChatRequest, json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18"}]}).encode())
    msgs = template_messages(req.messages)
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert msgs[2] == {"role": "tool", "content": "18", "tool_call_id": "call_1"}
    bad = P.parse(P.ChatRequest, json.dumps({"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": "[1]"}}]}]}).encode())
    with pytest.raises(P.RequestError) as e:
        template_messages(bad.messages)
    assert e.value.param == "messages.0.tool_calls.0.function.arguments"

    content, calls = reply("Let me look. " + CALL, tools_offered=True)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert reply(" x " + CALL, tools_offered=False) == (" x " + CALL, [])  # no tools offered: text as generated
    assert reply(" plain ", tools_offered=True) == (" plain ", [])


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 1000])
def test_stream_filter_holds_back_calls_however_split(cut):
    text = "Sure <tool" + "!" + " then " + CALL + " tail"
    f = StreamFilter(True)
    shown = "".join(f.push(text[i:i + cut]) for i in range(0, len(text), cut))
    rest, calls = f.finish()
    assert shown == "Sure <tool! then "  # a false start of the marker is let out once it cannot be one
    assert rest == "tail" and [c["function"]["name"] for c in calls] == ["weather"]
    g = StreamFilter(True)  # a block that is not a call comes out as text at the end
    shown = "".join(g.push(c) for c in "a <tool_call>oops</tool_call>")
    assert shown + g.finish()[0] == "a <tool_call>oops</tool_call>" and g.finish()[1] == []
    off = StreamFilter(False)
    assert off.push(CALL) == CALL and off.finish() == ("", [])


def test_serve_command_errors_are_named(tmp_path):
    from typer.testing import CliRunner

    from kiln.cli.main import app

    r = CliRunner().invoke(app, ["serve", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "no such model, checkpoint or run directory" in r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--lora", "justaname"])
    assert r.exit_code == 1 and "want NAME=ADAPTER_DIR" in r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--lora", f"a={tmp_path}"])
    assert r.exit_code == 1 and "no adapter_config.json" in r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--max-queue", "0"])
    assert r.exit_code == 1 and "--max-queue" in r.output
