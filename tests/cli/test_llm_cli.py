"""kiln tokenizer train, kiln generate and kiln chat end to end on a tiny Qwen3 with a trained BPE tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from kiln.interop.tiny import make_tiny

    d = tmp_path_factory.mktemp("llm")
    (d / "text.txt").write_text("hello there\nhow are you today\nthe weather is nice\n" * 5)
    r = CliRunner().invoke(app, ["tokenizer", "train", str(d / "text.txt"), "--out", str(d / "tok"),
                                 "--vocab-size", "300", "--min-frequency", "1"])
    assert r.exit_code == 0, r.output
    assert "eos_token=<|im_end|>" in r.output
    model = make_tiny("qwen3", "causal-lm", d / "model", tokenizer=False, vocab_size=300, eos_token_id=2,
                      pad_token_id=0, max_position_embeddings=256)  # room for a two-turn chat
    for f in (d / "tok").iterdir():
        shutil.copy(f, model / f.name)
    return model


def test_generate_is_greedy_and_matches_the_api(chat_model):
    from kiln.models import AutoModelForCausalLM

    r = CliRunner().invoke(app, ["generate", str(chat_model), "hello there", "-n", "6"])
    assert r.exit_code == 0, r.output
    model = AutoModelForCausalLM.from_pretrained(chat_model)
    ids = torch.tensor([model.tokenizer.backend.encode("hello there").ids])
    want = "hello there" + model.tokenizer.decode(model.generate(ids, max_new_tokens=6)[0, ids.size(1):].tolist())
    assert r.output.strip() == want.strip()


def test_chat_uses_the_template_and_keeps_history(chat_model):
    from kiln.data.sft import chat_prompt_ids
    from kiln.models import AutoModelForCausalLM

    r = CliRunner().invoke(app, ["chat", str(chat_model), "-n", "5", "--system", "be brief"],
                           input="hello\nhow are you\n\n")
    assert r.exit_code == 0, r.output
    replies = [line.split("bot> ", 1)[1] for line in r.output.splitlines() if "bot> " in line]
    assert len(replies) == 2
    model = AutoModelForCausalLM.from_pretrained(chat_model)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = torch.tensor([chat_prompt_ids(model.tokenizer, msgs)])
    first = model.tokenizer.decode(model.generate(ids, max_new_tokens=5)[0, ids.size(1):].tolist()).strip()
    assert replies[0] == first
    cfg = json.loads((chat_model / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]


def test_chat_image_command_mistakes_are_told_and_the_chat_goes_on(chat_model, tmp_path):
    """`/image` without a path, with a missing file, or on a model without a vision tower: one error line each,
    nothing attached, and the next message is answered as a plain text chat."""
    (tmp_path / "a.png").write_bytes(b"not read: the model takes no images")
    typed = f"/image\n/image {tmp_path / 'none.png'}\n/image {tmp_path / 'a.png'}\nhello\n\n"
    r = CliRunner().invoke(app, ["chat", str(chat_model), "-n", "3"], input=typed)
    assert r.exit_code == 0, r.output
    assert "error: /image: name an image file: /image PATH" in r.output
    assert f"error: /image: image file {tmp_path / 'none.png'} does not exist" in r.output
    assert "error: /image: " in r.output and "has no vision tower (model_type 'qwen3'); it takes no images" in r.output
    assert r.output.count("bot> ") == 1 and "goes with your next message" not in r.output


def test_generate_on_an_encoder_is_refused(tiny_factory):
    r = CliRunner().invoke(app, ["generate", str(tiny_factory("bert", "masked-lm")), "hi"])
    assert r.exit_code == 1 and "has no 'causal-lm' head" in r.output
