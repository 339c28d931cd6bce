"""`kiln train --config` with a tiny Mamba + [hpn] + [grow] + PCGrad on token shards that `kiln tokenize`
made from generated documents: growth at the configured step, both objectives in metrics.jsonl, the
frozen layer left alone; the command-line overrides (--set and the named flags) and their errors,
which read as the TOML key's own."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "past", "red", "houses", "and", "blue", "cars", "in", "the", "rain", "near", "quiet", "water"]


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer dir, shard dir): a 300-token BPE and `kiln tokenize` of 120 generated documents."""
    d = tmp_path_factory.mktemp("mamba-hpn")
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_docs(200, 1), BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (d / "tok").mkdir()
    tok.save(str(d / "tok" / "tokenizer.json"))
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(120, 7)))
    r = CliRunner().invoke(app, ["tokenize", str(d / "docs.jsonl"), "-t", str(d / "tok"), "-o", str(d / "shards"),
                                 "--val-fraction", "0.1", "--no-progress"])
    assert r.exit_code == 0, r.output
    return d / "tok", d / "shards"


def write_run(path: Path, tok: Path, shards: Path, out_dir: Path, placement: str = "insert:1") -> Path:
    path.write_text(f"""[model]
family = "mamba"
task = "causal-lm"
tokenizer = "{tok}"
[model.config]
vocab_size = 300
hidden_size = 16
state_size = 4
conv_kernel = 4
num_hidden_layers = 2
scan = "fast"

[data]
train = "{shards}"
eval = "{shards}"
max_length = 16

[train]
out_dir = "{out_dir}"
seed = 1
steps = 6
batch_size = 4
lr = 1e-2
warmup_steps = 1
eval_every = 3
save_every = 3
keep_last = 5
progress = false
device = "cpu"
weight_decay = 0.0

[hpn]
proto_dim = 8
scale = 10.0
mode = "fixed"
objectives = "pcgrad"

[grow]
at_step = 3
target_layers = 3
placement = "{placement}"
freeze_after = ["first:1"]
""")
    return path


def test_toml_run_grows_at_its_step_and_logs_both_objectives(tmp_path, shards):
    tok, shard_dir = shards
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--config", str(write_run(tmp_path / "run.toml", tok, shard_dir, run))])
    assert r.exit_code == 0, r.output
    assert "step 3: grew to 3 layers (insert:1)" in r.output and "done: step 6" in r.output

    records = read_metrics(run / "metrics.jsonl")
    steps = [rec for rec in records if "loss" in rec]
    assert [rec["step"] for rec in steps] == [1, 2, 3, 4, 5, 6]
    for rec in steps:  # the combined step's loss is the sum of the two objectives it combined
        assert rec["loss"] == pytest.approx(rec["loss_prototype"] + rec["loss_lm"], rel=1e-6)
    evals = [rec for rec in records if "eval_loss" in rec]
    assert [rec["step"] for rec in evals] == [3, 6] and all("eval_lm_loss" in rec for rec in evals)

    # ckpt-000003 is written after step 3's growth: layer 1 is the new one, old layer 1 is now layer 2
    grown = load_file(str(run / "ckpt-000003/model/model.safetensors"))
    last = load_file(str(run / "ckpt-000006/model/model.safetensors"))
    layers = lambda sd: {k.split(".layers.")[1].split(".")[0] for k in sd if ".layers." in k}  # noqa: E731
    assert layers(grown) == layers(last) == {"0", "1", "2"}
    new_out = next(k for k in grown if k.endswith("layers.1.mixer.out_proj.weight"))
    assert not grown[new_out].any() and last[new_out].any()   # zeroed at growth (identity), then trained
    frozen = [k for k in grown if ".layers.0." in k]          # freeze_after first:1: old layer 0 stops moving
    trained = [k for k in grown if ".layers.2." in k]
    assert frozen and all(torch.equal(grown[k], last[k]) for k in frozen)
    assert any(not torch.equal(grown[k], last[k]) for k in trained)


def test_named_flags_override_model_hpn_and_grow(tmp_path, shards):
    tok, shard_dir = shards
    run = tmp_path / "run"
    cfg = write_run(tmp_path / "run.toml", tok, shard_dir, tmp_path / "unused")
    r = CliRunner().invoke(app, ["train", "--config", str(cfg), "--set", f"train.out_dir={run}", "--set", "train.steps=3",
                                 "--d-model", "24", "--d-state", "2", "--d-conv", "3", "--layers", "1",
                                 "--placement", "append", "--target-layers", "2", "--grow-at", "2",
                                 "--freeze", "embeddings", "--freeze-after", "last:1", "--scale", "5",
                                 "--prototype-mode", "learnable", "--proto-dim", "6", "--objectives", "sum"])
    assert r.exit_code == 0, r.output
    assert "step 2: grew to 2 layers (append)" in r.output and "done: step 3" in r.output
    state = json.loads((run / "ckpt-000003" / "trainer.json").read_text())["run_config"]
    assert state["model"]["config"] == {"vocab_size": 300, "hidden_size": 24, "state_size": 2, "conv_kernel": 3,
                                        "num_hidden_layers": 1, "scan": "fast"}
    assert {k: state["hpn"][k] for k in ("scale", "mode", "proto_dim", "objectives")} == \
        {"scale": 5.0, "mode": "learnable", "proto_dim": 6, "objectives": "sum"}
    assert state["grow"] == {"at_step": 2, "target_layers": 2, "placement": "append", "freeze": ["embeddings"],
                             "freeze_after": ["last:1"]}
    weights = load_file(str(run / "ckpt-000003/model/model.safetensors"))
    conv = next(v for k, v in weights.items() if k.endswith("layers.1.mixer.conv1d.weight"))
    assert conv.shape == (48, 1, 3)   # d_inner = expand 2 * d_model 24, kernel 3: the grown layer has them too


def test_override_and_toml_keys_fail_with_the_same_message(tmp_path, shards):
    tok, shard_dir = shards
    bad_toml = write_run(tmp_path / "bad.toml", tok, shard_dir, tmp_path / "bad", placement="middle")
    r = CliRunner().invoke(app, ["train", "--config", str(bad_toml)])
    assert r.exit_code == 1
    msg = "grow.placement: 'middle' is not a placement: use append, prepend, insert:N or specific:i,j,..."
    line = bad_toml.read_text().splitlines().index('placement = "middle"') + 1
    assert f"{bad_toml}:{line}: {msg}" in " ".join(r.output.split())

    cfg = write_run(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run")
    for args, expected in ((["--placement", "middle"], f"command line: {msg}"),
                           (["--set", "grow.placement=middle"], f"command line: {msg}"),
                           (["--freeze-after", "top:1"], "command line: grow.freeze_after: 'top:1' is not a freeze "
                                                         "spec; use first:N, last:N, layers:i,j,..., embeddings"),
                           (["--prototype-mode", "spinning"], "command line: hpn.mode: Input should be 'fixed' or "
                                                              "'learnable'"),
                           (["--scale", "big"], "command line: hpn.scale: Input should be a valid number"),
                           (["--set", "hpn.modes=fixed"], "command line: unknown key 'hpn.modes'"),
                           (["--set", "grow"], "--set 'grow': expected section.key=value"),
                           (["--placement", "insert:5"], "grow.placement 'insert:5' is not valid for 2 -> 3 layers")):
        r = CliRunner().invoke(app, ["train", "--config", str(cfg), *args])
        assert r.exit_code == 1 and expected in " ".join(r.output.split()), (args, r.output)
    assert not (tmp_path / "run").exists()   # every one failed before training began


def test_override_paths_resolve_against_the_working_directory(tmp_path, shards, monkeypatch):
    tok, shard_dir = shards
    (tmp_path / "sub").mkdir()
    cfg = write_run(tmp_path / "sub" / "run.toml", tok, shard_dir, tmp_path / "run")
    monkeypatch.chdir(shard_dir.parent)
    loaded = load_run_config(cfg, [("data.eval", "shards"), ("model.config.hidden_size", 32)])
    assert loaded.data.eval == str(shard_dir.parent / "shards") and loaded.data.train == str(shard_dir)
    assert loaded.model.config["hidden_size"] == 32
