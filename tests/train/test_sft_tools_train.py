"""An SFT run on tool-calling rows (tools, calls, results, reasoning; Qwen3's template) learns its calls."""

from __future__ import annotations

import json
from importlib import resources

import torch
from typer.testing import CliRunner

from kiln.cli.main import app

CITIES = ["Paris", "London", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Tokyo"]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _row(city: str, temp: int) -> dict:
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "content": json.dumps({"temp": temp})},
        {"role": "assistant", "content": f"It is {temp} degrees in {city}."}]}


def test_sft_on_tool_rows_learns(tmp_path):
    from kiln.data.bpe import train_bpe
    from kiln.data.records import read_records
    from kiln.data.sft import encode_sft
    from kiln.hub import ChatTemplate, Tokenizer
    from kiln.models import AutoModelForCausalLM

    rows = [_row(c, 10 + 3 * i) for i, c in enumerate(CITIES)]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    rendered = tmp_path / "rendered.txt"  # the tokenizer learns the template's text too (the tools block is long)
    rendered.write_text("\n".join(ChatTemplate(template).render(r["messages"], tools=TOOLS) for r in rows))
    train_bpe([data, rendered], tmp_path / "tok", vocab_size=600, min_frequency=1)
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    examples, stats = encode_sft(read_records(data), Tokenizer.from_dir(tmp_path / "tok"), max_length=512)
    assert stats.truncated == 0 and max(len(e["input_ids"]) for e in examples) <= 384
    (tmp_path / "run.toml").write_text(f"""
[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "tok"
[model.config]
vocab_size = 600
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
max_position_embeddings = 384
pad_token_id = 0
eos_token_id = 2
[data]
train = "tools.jsonl"
max_length = 384
pack = false
[train]
out_dir = "{tmp_path / 'run'}"
steps = 16
batch_size = 2
schedule = "constant"
lr = 2e-2
weight_decay = 0.0
progress = false
log_every = 1
""")
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "run.toml")])
    assert r.exit_code == 0, r.output
    losses = [x["loss"] for x in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in x]
    assert len(losses) == 16
    # a fresh model's loss is about ln(600) = 6.4 per token; a run that learns the call layout (the tool-call
    # JSON, the think block, the reply template) is far below half of it by the end
    assert sum(losses[:3]) / 3 > 4.5 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:3]) / 3, losses
    model = AutoModelForCausalLM.from_pretrained(sorted((tmp_path / "run").glob("ckpt-*"))[-1] / "model")
    with torch.no_grad():
        ids, labels = examples[0]["input_ids"][None], examples[0]["labels"][None]
        assert model(input_ids=ids, labels=labels).loss.item() < 0.5 * losses[0]
