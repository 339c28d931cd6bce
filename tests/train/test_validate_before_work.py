"""Validate before work (issue 41, class 5): every float setting of every table finite and in its range (one
pydantic type, kiln.parallel.config.finite), a from-config model's sizes (odd head_dim under RoPE, zero heads),
the DPO reference's vocabulary against the tokenizer, and a 4-bit directory's quant state finite. Each case asserts
the message naming the key or tensor, the exit code, and that nothing in the case's folder changed."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError, WeightsError
from kiln.train.config import load_run_config
from tests.cli.bad_inputs_world import write_toml
from tests.cli.reliability_world import pretrain_config, raw_shards, run_cli, snapshot
from tests.train.dpo_helpers import QWEN3, make_tokenizer, standard_pairs, write_jsonl

# (section.key, value, what the message says) for a pretrain run from raw ids (core tables and extensions)
FLOATS = [
    ("train.lr", float("nan"), "train.lr must be a finite number >= 0, got nan"),
    ("train.lr", float("inf"), "train.lr must be a finite number >= 0, got inf"),
    ("train.weight_decay", -0.1, "train.weight_decay must be a finite number >= 0, got -0.1"),
    ("train.eps", 0.0, "train.eps must be a finite number > 0, got 0.0"),
    ("train.min_lr_ratio", float("nan"), "train.min_lr_ratio must be a finite number >= 0 and <= 1, got nan"),
    ("train.clip_grad_norm", float("inf"), "train.clip_grad_norm must be a finite number >= 0, got inf"),
    ("train.epochs", float("inf"), "train.epochs must be a finite number > 0, got inf"),
    ("train.betas", [0.9, float("nan")], "train.betas.1 must be a finite number >= 0 and < 1, got nan"),
    ("data.val_fraction", float("nan"), "data.val_fraction must be a finite number >= 0 and < 1, got nan"),
    ("hpn.scale", float("inf"), "hpn.scale must be a finite number > 0, got inf"),
    ("hpn.gradnorm_lr", float("nan"), "hpn.gradnorm_lr must be a finite number >= 0, got nan"),
    ("ff.ff_lr", float("inf"), "ff.ff_lr must be a finite number >= 0, got inf"),
    ("moe.mtp_weight", float("nan"), "moe.mtp_weight must be a finite number >= 0, got nan"),
    ("parallel.cadence.target_sync_share", float("inf"), "parallel.cadence.target_sync_share must be a finite "
                                                          "number > 0 and < 1, got inf"),
]


def _set(sections: dict, dotted: str, value) -> dict:
    *path, leaf = dotted.split(".")
    table = sections
    for p in path:
        table = table.setdefault(p, {})
    table[leaf] = value
    return sections


@pytest.mark.parametrize("key,value,says", FLOATS, ids=[f"{k}={v}" for k, v, _ in FLOATS])
def test_every_float_setting_is_finite_and_in_range(tmp_path, key, value, says):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "run.toml", tok, tmp_path / "out")
    import tomllib

    sections = tomllib.loads(cfg.read_text())
    write_toml(cfg, _set(sections, key, value))
    with pytest.raises(ConfigError) as e:
        load_run_config(cfg)
    assert says in str(e.value) and str(cfg) in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def dpo_world(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    rows = standard_pairs(8)
    tok = make_tokenizer(d, rows)
    write_jsonl(d / "pairs.jsonl", rows)
    return d, tok


def _dpo_config(d, tok, name: str, dpo: dict, **model) -> str:
    return write_toml(d / f"{name}.toml", {
        "model": {"family": "qwen3", "task": "causal-lm", "tokenizer": tok, "config": QWEN3, **model},
        "data": {"train": d / "pairs.jsonl", "max_length": 48},
        "train": {"out_dir": d / "runs" / name, "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"},
        "dpo": dpo})


@pytest.mark.parametrize("dpo,says", [
    ({"beta": float("inf")}, "dpo.beta must be a finite number > 0, got inf"),
    ({"beta": float("nan")}, "dpo.beta must be a finite number > 0, got nan"),
    ({"loss_type": "orpo", "lambda": -1.0}, "dpo.lambda must be a finite number >= 0, got -1.0"),
    ({"loss_type": "simpo", "gamma": float("-inf")}, "dpo.gamma must be a finite number >= 0, got -inf"),
    ({"label_smoothing": 0.5}, "dpo.label_smoothing must be a finite number >= 0 and < 0.5, got 0.5"),
], ids=["beta-inf", "beta-nan", "orpo-lambda-negative", "simpo-gamma-minus-inf", "smoothing-half"])
def test_dpo_settings_refused_by_kiln_train(dpo_world, dpo, says):
    d, tok = dpo_world
    cfg = _dpo_config(d, tok, "bad", dpo)
    before = snapshot(d)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and says in out and "bad.toml:" in out and "Traceback" not in out, out
    assert snapshot(d) == before and not (d / "runs" / "bad").exists()


def test_dpo_reference_with_a_smaller_vocabulary_is_refused_before_training(dpo_world, tiny_factory):
    d, tok = dpo_world
    small = tiny_factory("qwen3", "causal-lm", vocab_size=120)
    cfg = _dpo_config(d, tok, "ref", {"reference": str(small)})
    before = snapshot(d)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1, out
    from kiln.hub.tokenizer import Tokenizer

    n = Tokenizer.from_dir(tok).vocab_size
    assert n > 120
    assert f"dpo.reference {small}: its vocab_size is 120 but the tokenizer has {n} tokens" in out, out
    assert "IndexError" not in out and "Traceback" not in out
    assert snapshot(d) == before and not (d / "runs" / "ref").exists()


@pytest.mark.parametrize("config,says", [
    ({"head_dim": 7}, "RoPE turns a head's dims in pairs, so they must be even; head_dim (7) gives 7 dims per head"),
    ({"head_dim": None, "hidden_size": 36, "num_attention_heads": 4, "num_key_value_heads": 2},
     "hidden_size / num_attention_heads (36 / 4) gives 9 dims per head"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"head_dim": None, "hidden_size": 30}, "hidden_size (30) must be a multiple of num_attention_heads (4)"),
], ids=["odd-head-dim", "odd-derived-head-dim", "zero-heads", "zero-layers", "kv-heads", "hidden-heads"])
def test_from_config_model_sizes_refused_naming_the_key(tmp_path, config, says):
    tok = raw_shards(tmp_path / "tok", 1)
    # llama: an unset head_dim is hidden_size / num_attention_heads (qwen3's own default is 128)
    cfg = pretrain_config(tmp_path / "run.toml", tok, tmp_path / "out", config=config, family="llama")
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and says in out and "Traceback" not in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_nan_in_a_4bit_quant_state_is_refused_naming_the_tensor(tiny_factory, tmp_path):
    from kiln.interop.export import export_model
    from kiln.models.auto import load_pretrained

    q = tmp_path / "nf4"
    export_model(tiny_factory("qwen3", "causal-lm"), q, quantize="nf4")
    weights = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight.nested_absmax"
    assert name in weights
    load_pretrained(q)  # a control: the clean directory loads
    bad = tmp_path / "bad"
    shutil.copytree(q, bad)
    poisoned = dict(weights)
    poisoned[name] = weights[name].clone()
    poisoned[name][0] = float("nan")
    save_file(poisoned, str(bad / "model.safetensors"), metadata={"format": "pt"})
    before = snapshot(bad)
    with pytest.raises(WeightsError, match=f"quant-state tensor '{name}' holds 1 non-finite value"):
        load_pretrained(bad)
    cfg = write_toml(tmp_path / "run.toml", {
        "model": {"path": bad, "task": "causal-lm"}, "lora": {"r": 2},
        "data": {"train": write_jsonl(tmp_path / "chat.jsonl", [{"text": "the cat sat on the mat"}] * 4),
                 "max_length": 16},
        "train": {"out_dir": tmp_path / "out", "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"}})
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and f"quant-state tensor '{name}' holds 1 non-finite value" in out, out
    assert snapshot(bad) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("config,says", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rope_theta": -1.0}, "rope_theta must be a finite number > 0, got -1.0"),
    ({"attention_dropout": 2.0}, "attention_dropout must be a finite number >= 0 and < 1, got 2.0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1, got 0"),
], ids=["eps-nan", "theta-negative", "dropout-2", "positions-0"])
def test_from_config_float_fields_refused(tmp_path, config, says):
    """Found by the sweep: a NaN eps or a negative rope base ran every step as NaN and ended "done"; a dropout
    of 2 was a traceback (exit 70); 0 positions trained."""
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "run.toml", tok, tmp_path / "out", config=config)
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and says in out and "Traceback" not in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()
