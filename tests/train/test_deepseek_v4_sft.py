"""`kiln train` SFT on DeepSeek-V4 (built from config, chat JSONL): full and LoRA runs with aux-loss-free balancing of
the top-k layers (the hash-routed layer has no bias), merged export read by transformers, SIGKILL then resume exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.interop.tiny import TINY
from kiln.train.metrics import read_metrics
from tests.train.test_sft_train import CHATS
from tests.train.train_helpers import kiln

V4 = {**TINY["deepseek_v4"], "vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# attention (kv_proj also names the compressors' own) and the shared expert's up/down (the routed experts are
# stacked tensors, no Linears); not gate_proj: the adapter config keeps leaf names, which would also name the
# compressors' gate_proj on reload
LORA = '[lora]\nr = 4\nalpha = 8\ntargets = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "up_proj", "down_proj"]\n'


def _value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_value(x)}' for k, x in v.items()) + " }"
    return json.dumps(v)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("v4-sft")
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _toml(d, name: str, extra: str = "", steps: int = 8) -> str:
    path = d / f"{name}.toml"
    path.write_text(f'[model]\nfamily = "deepseek_v4"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n[model.config]\n'
                    + "".join(f"{k} = {_value(v)}\n" for k, v in V4.items())
                    + f'[data]\ntrain = "{d / "chat.jsonl"}"\nmax_length = 48\n'
                    + f'[train]\nout_dir = "{d / name}"\nsteps = {steps}\nbatch_size = 4\nlr = 1e-2\n'
                    + "weight_decay = 0.0\nsave_every = 3\nkeep_last = 5\nprogress = false\nlog_every = 1\nseed = 3\n"
                    + '[moe]\nbalance = "aux_free"\nbias_update_speed = 1e-2\n' + extra)
    return str(path)


def _losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trains_balances_top_k_layers_and_exports(setup, lora):
    name = "lora" if lora else "full"
    r = CliRunner().invoke(app, ["train", "--config", _toml(setup, name, LORA if lora else "")])
    assert r.exit_code == 0, r.output
    assert "does not keep packed samples apart" in r.output  # compressors pool across samples: one per row
    run = setup / name
    losses = _losses(run)
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3])
    metrics = read_metrics(run / "metrics.jsonl")[-1]
    assert {"moe_max_load.model.layers.1", "moe_max_load.model.layers.2"} <= set(metrics)
    assert not any(k.endswith("layers.0") for k in metrics)  # the hash-routed layer has no router to balance
    ckpt = sorted(run.glob("ckpt-*"))[-1]
    weights = load_file(str(ckpt / "model" / "model.safetensors"))
    for i in (1, 2):  # the biases moved; DeepSeek-V4 names them ffn.gate.bias on disk
        assert bool(weights[f"model.layers.{i}.ffn.gate.bias"].abs().sum() > 0)
    assert "model.layers.0.ffn.gate.bias" not in weights and "model.layers.0.ffn.gate.tid2eid" in weights
    assert (ckpt / "model" / "adapter_model.safetensors").is_file() == lora
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt), "--out", str(setup / f"export-{name}")])
    assert r.exit_code == 0, r.output

    import transformers

    from kiln.models import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    exported = transformers.AutoModelForCausalLM.from_pretrained(setup / f"export-{name}").eval()
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 3, 8, 11, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(setup):
    kiln("train", "--config", _toml(setup, "straight", steps=6))
    cfg = _toml(setup, "killed", steps=6)
    p = kiln("train", "--config", cfg, env={"KILN_FAULT": "step:5"}, check=False)
    assert p.returncode == -9, p.stderr
    p = kiln("train", "--config", cfg, "--resume", str(setup / "killed"))
    assert "from ckpt-000003" in p.stdout
    a = load_file(str(setup / "straight" / "ckpt-000006" / "model" / "model.safetensors"))
    b = load_file(str(setup / "killed" / "ckpt-000006" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the balancing biases included

    def curve(run):
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in read_metrics(run / "metrics.jsonl")]

    assert curve(setup / "killed") == curve(setup / "straight")
