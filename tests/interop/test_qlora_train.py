"""QLoRA SFT through `kiln train`: a bf16 checkpoint quantized to NF4 at load (`[model] quantize`), LoRA on
top; train and held-out losses fall, the base stays 4-bit, and the adapter loads in PEFT on transformers'
bitsandbytes-4bit model of the same checkpoint with kiln's logits, bit for bit; merged exports."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.interop.qlora_cases import logits, transformers_bnb4, transformers_model

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(8) for b in range(4)]
TRAIN = [c for i, c in enumerate(CHATS) if i % 4]
HELD_OUT = [c for i, c in enumerate(CHATS) if not i % 4]  # sums the run never sees asked


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    d = tmp_path_factory.mktemp("qlora-sft")
    for name, chats in (("train", TRAIN), ("eval", HELD_OUT)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    train_bpe([d / "train.jsonl"], d / "tok", vocab_size=300, min_frequency=1)
    # every Linear input a multiple of 64 (see tests/interop/qlora_cases.py)
    config = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, pad_token_id=0, eos_token_id=2)
    model = from_config(config, task="causal-lm", seed=0).to(torch.bfloat16)
    model.config.extra["dtype"] = "bfloat16"
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    model.save_pretrained(d / "bf16")
    return d


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_qlora_sft_learns_and_its_adapter_loads_in_peft(setup):
    d = setup
    cfg = d / "qlora.toml"
    cfg.write_text(f"""
[model]
path = "{d / 'bf16'}"
task = "causal-lm"
quantize = "nf4"
[data]
train = "{d / 'train.jsonl'}"
eval = "{d / 'eval.jsonl'}"
max_length = 48
pack = true
[train]
out_dir = "{d / 'run'}"
steps = 16
batch_size = 4
lr = 1e-2
weight_decay = 0.0
eval_every = 4
progress = false
log_every = 1
[lora]
r = 8
alpha = 16
targets = "all-linear"
""")
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = _metrics(d / "run")
    losses = [m["loss"] for m in rows if "loss" in m]
    evals = [m["eval_loss"] for m in rows if "eval_loss" in m]
    assert len(losses) == 16 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert len(evals) >= 2 and evals[-1] < evals[0], evals

    ckpt = sorted((d / "run").glob("ckpt-*"))[-1] / "model"
    from kiln.models.auto import load_pretrained
    from kiln.models.common.quant4 import Linear4

    trained = load_pretrained(ckpt)
    base = trained.model.layers[0].mlp.down_proj
    assert base.weight.dtype == torch.uint8 and base.lora_A.weight.dtype == torch.float32
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "bitsandbytes"
    assert not any(isinstance(m, Linear4) for m in [trained.lm_head])

    # PEFT finds the base from the adapter's config: the run's model.path
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(d / "bf16")
    adapter = d / "adapter"
    adapter.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(ckpt / f, adapter / f)
    hf_dir = transformers_bnb4(d / "bf16", d / "hf-nf4", compute=torch.bfloat16)
    peft = transformers_model(hf_dir, adapter)
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 33, 2], [4, 4, 80, 12, 7, 90, 41, 5]])
    want, got = logits(peft, ids).float(), logits(trained, ids).float()
    # the same bf16 arithmetic as PEFT over bitsandbytes' Linear4bit (update rounded to bf16, then added)
    assert torch.equal(got, want), (got - want).abs().max()
    # the control: the trained adapter moved the logits (so the equality is about the adapter too)
    untrained = transformers_model(hf_dir)
    assert (logits(untrained, ids).float() - want).abs().max() > 0.05
    # a merge rounds W + B A s to bf16 once per weight instead of the update once per output: a few bf16
    # roundings (relative 2**-8 each) of activations on the logits' scale
    bound = 4 * 2.0**-8 * want.abs().max()

    # merged export: dequantized, merged, written bf16 with no quantization left; or re-quantized on request
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt.parent), "--out", str(d / "merged")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((d / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg and not (d / "merged" / "adapter_config.json").exists()
    merged = load_pretrained(d / "merged")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    assert (logits(merged, ids).float() - got).abs().max() <= bound
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt.parent), "--out", str(d / "merged4"),
                                 "--quantize", "nf4"])
    assert r.exit_code == 0, r.output
    requantized = load_pretrained(d / "merged4")
    assert requantized.model.layers[1].self_attn.o_proj.weight.dtype == torch.uint8
    assert torch.equal(logits(transformers_model(d / "merged4"), ids), logits(requantized, ids))
