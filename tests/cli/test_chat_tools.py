"""kiln chat with --tools: tool calls and reasoning in a reply are shown, the next line goes back as the
tool's result, and the prompt is the template's rendering with the tools (Qwen3's template)."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.hub.chat import parse_reply

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SCRIPT = ['<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call><|im_end|>', "It is 18 degrees.<|im_end|>"]


def test_parse_reply_reads_reasoning_calls_and_text():
    msg = parse_reply(SCRIPT[0].replace("<|im_end|>", "") + "\nand <tool_call>{not json}</tool_call>")
    assert msg == {"role": "assistant", "reasoning_content": "The user wants weather.", "content": "and <tool_call>{not json}</tool_call>",
                   "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}
    assert parse_reply("plain") == {"role": "assistant", "content": "plain"}


@pytest.fixture(scope="module")
def qwen3_chat_model(tmp_path_factory):
    from kiln.data.bpe import train_bpe
    from kiln.interop.tiny import make_tiny

    d = tmp_path_factory.mktemp("chat-tools")
    (d / "text.txt").write_text("\n".join(SCRIPT) + "\nWeather in Paris?\n{\"temp\": 18}\n")
    train_bpe([d / "text.txt"], d / "tok", vocab_size=300, min_frequency=1)
    model = make_tiny("qwen3", "causal-lm", d / "model", tokenizer=False, vocab_size=300, eos_token_id=2, pad_token_id=0)
    for f in (d / "tok").iterdir():
        shutil.copy(f, model / f.name)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "tools.json").write_text(json.dumps(TOOLS))
    return model, d / "tools.json"


def test_chat_shows_tool_calls_and_sends_results_back(qwen3_chat_model, monkeypatch):
    """The model's replies are scripted (a tiny random model calls no tool); all else is the real command."""
    import kiln.engine.continuer as continuer

    model_dir, tools = qwen3_chat_model
    prompts = []

    class Scripted(continuer.Continuer):
        def __call__(self, prompt, prompt_inputs=None):
            prompts.append(self.model.tokenizer.decode(prompt, skip_special_tokens=False))
            return self.model.tokenizer.backend.encode(SCRIPT[len(prompts) - 1], add_special_tokens=False).ids

    monkeypatch.setattr(continuer, "Continuer", Scripted)
    r = CliRunner().invoke(app, ["chat", str(model_dir), "--tools", str(tools)], input='Weather in Paris?\n{"temp": 18}\n\n')
    assert r.exit_code == 0, r.output
    assert "think> The user wants weather." in r.output
    assert 'call> weather({"city": "Paris"})' in r.output and "bot> It is 18 degrees." in r.output
    assert "tool> " in r.output and len(prompts) == 2
    assert '"name": "weather"' in prompts[0] and "<tools>" in prompts[0]  # the tools block was rendered
    assert prompts[1].endswith('<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>\n'
                               '<|im_start|>assistant\n')
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompts[1]


def test_bad_tools_file_is_named(qwen3_chat_model, tmp_path):
    model_dir, _ = qwen3_chat_model
    (tmp_path / "t.json").write_text('{"name": "weather"}')
    r = CliRunner().invoke(app, ["chat", str(model_dir), "--tools", str(tmp_path / "t.json")], input="\n")
    assert r.exit_code == 1 and "t.json: want a JSON list of function schemas" in r.output
