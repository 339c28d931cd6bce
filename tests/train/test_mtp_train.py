"""`[moe] mtp_weight` through `kiln train` for Qwen3.5/3.6-MoE and DeepSeek-V4 (built from config, a fresh MTP module):
the MTP loss is logged apart and falls, the checkpoint holds the module under the release's names, and a run
SIGKILLed mid-way resumes to the uninterrupted run's weights and metrics exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kiln.interop.tiny import TINY
from kiln.models.qwen3_next import TINY_HYBRID_MOE
from kiln.train.metrics import read_metrics
from tests.train.test_sft_train import CHATS
from tests.train.train_helpers import killed_then_resumed_matches

SPECIAL_IDS = {"vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "deepseek_v4": {**TINY["deepseek_v4"], **SPECIAL_IDS},
    "qwen3_5_moe": {"text_config": {**TINY_HYBRID_MOE, **SPECIAL_IDS}, **SPECIAL_IDS},
}
MTP_NAMES = {"deepseek_v4": ("mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.0.w1.weight"),
             "qwen3_5_moe": ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight")}


def _value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_value(x)}' for k, x in v.items()) + " }"
    return json.dumps(v)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("mtp")
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _toml(d, family: str, name: str) -> str:
    balance = "aux_free" if family == "deepseek_v4" else "none"  # Qwen3.5's softmax router has no bias to move
    path = d / f"{name}.toml"
    path.write_text(f'[model]\nfamily = "{family}"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n[model.config]\n'
                    + "".join(f"{k} = {_value(v)}\n" for k, v in CONFIGS[family].items())
                    + f'[data]\ntrain = "{d / "chat.jsonl"}"\nmax_length = 40\n'
                    + f'[train]\nout_dir = "{d / name}"\nsteps = 4\nbatch_size = 2\nlr = 1e-2\n'
                    + "weight_decay = 0.0\nsave_every = 2\nkeep_last = 5\nprogress = false\nlog_every = 1\nseed = 3\n"
                    + f'[moe]\nbalance = "{balance}"\nmtp_weight = 0.5\n')
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v4"])
def test_mtp_trains_logs_apart_and_resumes_exactly(setup, family):
    straight, killed = _toml(setup, family, f"{family}-straight"), _toml(setup, family, f"{family}-killed")
    # weights and metrics bit for bit; the uninterrupted run in this process (one interpreter start fewer)
    killed_then_resumed_matches(Path(straight), Path(killed), fault="step:3", steps=(4,), ref_in_process=True)
    run = setup / f"{family}-straight"
    records = [r for r in read_metrics(run / "metrics.jsonl") if "mtp_loss" in r]
    assert len(records) == 4 and all(r["lm_loss"] > 0 for r in records)
    # loss = lm_loss + 0.5 * mtp_loss per step (the MTP loss logged apart, unweighted)
    assert all(abs(r["loss"] - (r["lm_loss"] + 0.5 * r["mtp_loss"])) < 1e-4 * r["loss"] for r in records)
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]
    weights = load_file(str(run / "ckpt-000004" / "model" / "model.safetensors"))
    assert all(k in weights for k in MTP_NAMES[family])
