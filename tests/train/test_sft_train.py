"""`kiln train --config` for causal-LM SFT: full and LoRA runs from TOML, adapters in the checkpoint, merged export."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app

CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(6) for b in range(4)]


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("sft")
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _toml(d, extra: str, out: str) -> str:
    return f"""
[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "tok"
[model.config]
vocab_size = 300
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
max_position_embeddings = 64
pad_token_id = 0
eos_token_id = 2
[data]
train = "chat.jsonl"
eval = "chat.jsonl"
max_length = 48
pack = true
[train]
out_dir = "{d / out}"
steps = 12
batch_size = 4
lr = 1e-2
weight_decay = 0.0
progress = false
log_every = 1
{extra}
"""


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_from_toml_trains_and_exports(sft_setup, lora):
    d = sft_setup
    name = "lora" if lora else "full"
    cfg = d / f"{name}.toml"
    cfg.write_text(_toml(d, '[lora]\nr = 4\nalpha = 8\ntargets = "all-linear"' if lora else "", f"run-{name}"))
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    run = d / f"run-{name}"
    losses = _losses(run)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    ckpt = sorted(run.glob("ckpt-*"))[-1]
    assert (ckpt / "model" / "adapter_model.safetensors").is_file() == lora
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt), "--out", str(d / f"export-{name}")])
    assert r.exit_code == 0, r.output
    assert not (d / f"export-{name}" / "adapter_config.json").exists()  # merged: a plain HF directory

    from kiln.models import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    exported = AutoModelForCausalLM.from_pretrained(d / f"export-{name}")
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)


def test_unknown_sft_key_and_bad_target_are_named(sft_setup):
    d = sft_setup
    cfg = d / "bad.toml"
    cfg.write_text(_toml(d, "[lora]\ntargets = [\"qkv_proj\"]", "run-bad"))
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 1 and "['qkv_proj'] match no Linear layer" in r.output
    cfg.write_text(_toml(d, "", "run-bad").replace("pack = true", "pack = true\npacking = 1"))
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 1 and "unknown key 'data.packing'" in r.output


def test_lora_sft_on_an_fp8_base_keeps_the_base_fp8(sft_setup, tmp_path):
    """model.fp8 = "keep": the base stays float8 (frozen) through a [lora] run; the checkpoint writes it back as read."""
    from safetensors.torch import load_file

    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config
    from tests.models.fp8_cases import make_fp8

    d = sft_setup
    config = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                  pad_token_id=0, eos_token_id=2)
    model = from_config(config, task="causal-lm", seed=0)
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    model.save_pretrained(tmp_path / "plain")
    fp8_dir = make_fp8(tmp_path / "plain", tmp_path / "fp8", "Qwen3ForCausalLM")
    toml = _toml(d, '[lora]\nr = 4\nalpha = 8\ntargets = "all-linear"', "run-fp8")
    toml = toml.replace('family = "qwen3"', f'path = "{fp8_dir}"\nfp8 = "keep"').replace('tokenizer = "tok"\n', "")
    toml = toml[:toml.index("[model.config]")] + toml[toml.index("[data]"):]
    (d / "fp8.toml").write_text(toml)
    r = CliRunner().invoke(app, ["train", "--config", str(d / "fp8.toml")])
    assert r.exit_code == 0, r.output
    losses = _losses(d / "run-fp8")
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    ckpt = sorted((d / "run-fp8").glob("ckpt-*"))[-1] / "model"
    assert (ckpt / "adapter_model.safetensors").is_file()
    saved, source = load_file(str(ckpt / "model.safetensors")), load_file(str(fp8_dir / "model.safetensors"))
    fp8_keys = [k for k, v in source.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8_keys and all(saved[k].dtype == torch.float8_e4m3fn and torch.equal(saved[k].view(torch.uint8),
                                                                                   source[k].view(torch.uint8))
                            for k in fp8_keys)
