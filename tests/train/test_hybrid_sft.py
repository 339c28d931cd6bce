"""`kiln train` SFT on the Gated DeltaNet hybrids (qwen3_next, qwen3_5_moe_text), built from config, chat JSONL,
packing on: full and LoRA runs lower the loss. LoRA on attention, DeltaNet projections and MLPs merges into an
export transformers reads with kiln's logits; the LoRA checkpoint is a PEFT adapter that peft loads onto the
transformers model with kiln's logits, bit for bit.

peft (on transformers 5) reads the target names gate_proj/up_proj/down_proj of these MoE families as the routed
experts' stacked parameters, whatever module they named, so the adapter it is given targets the MLP through the
shared expert's gate instead of those names (kiln's adapter on them is checked through the merged export).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.interop.tiny import TINY
from kiln.train.metrics import read_metrics
from tests.train.test_sft_train import CHATS

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DELTANET = {"qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
            "qwen3_5_moe_text": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]}
TARGETS = {"mlp": ["gate_proj", "up_proj", "down_proj"], "peft": ["shared_expert_gate"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("hybrid-sft")
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _toml(d, model_type: str, name: str, targets: list[str] | None) -> str:
    config = {**TINY[model_type], "vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    extra = f'[lora]\nr = 4\nalpha = 8\ntargets = {json.dumps(targets)}\n' if targets else ""
    path = d / f"{name}.toml"
    path.write_text(f'[model]\nfamily = "{model_type}"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n'
                    "[model.config]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items())
                    + f'[data]\ntrain = "{d / "chat.jsonl"}"\nmax_length = 48\npack = true\n'
                    + f'[train]\nout_dir = "{d / name}"\nsteps = 10\nbatch_size = 4\nlr = 1e-2\n'
                    + "weight_decay = 0.0\nprogress = false\nlog_every = 1\nseed = 3\n" + extra)
    return str(path)


@pytest.mark.parametrize("lora", ["full", "mlp", "peft"])
@pytest.mark.parametrize("model_type", list(DELTANET))
def test_packed_sft_trains_and_transformers_reads_the_result(setup, model_type, lora, tmp_path):
    name = f"{model_type}-{lora}"
    targets = None if lora == "full" else ATTENTION + DELTANET[model_type] + TARGETS[lora]
    r = CliRunner().invoke(app, ["train", "--config", _toml(setup, model_type, name, targets)])
    assert r.exit_code == 0, r.output
    assert "does not keep packed samples apart" not in r.output  # the state restarts per sample: packing stays on
    losses = [m["loss"] for m in read_metrics(setup / name / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3])
    ckpt = sorted((setup / name).glob("ckpt-*"))[-1] / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() == (targets is not None)

    import transformers
    from safetensors.torch import load_file

    from kiln.models import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(ckpt).eval()  # base + adapter, exact path
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 3, 8, 11, 30, 2]])
    with torch.no_grad():
        want = ours(ids).logits
    if targets is None:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    else:
        adapter = load_file(str(ckpt / "adapter_model.safetensors"))
        for target in targets:  # every target got its pair of matrices
            assert any(f".{target}.lora_A." in k for k in adapter), target
    if lora == "mlp":  # merged into the base: a plain HF directory
        r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt.parent), "--out", str(tmp_path / "merged")])
        assert r.exit_code == 0, r.output
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
        return
    if lora == "peft":
        import peft

        base, adapter_dir = tmp_path / "base", tmp_path / "adapter"
        base.mkdir(), adapter_dir.mkdir()
        for f in ckpt.iterdir():  # the base weights and the adapter side by side, as a user would keep them
            shutil.copy(f, adapter_dir if f.name.startswith("adapter_") else base)
        theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                                adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, want, rtol=0, atol=0)
