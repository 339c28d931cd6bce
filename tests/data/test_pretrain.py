"""Pre-training from token shards through the Trainer and `kiln train`: SIGKILL and resume reads the
same windows, validation loss and perplexity, the cursor in checkpoints and run_state.json, attention
kept within documents, and the config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.data.shards import ShardError, ShardSet
from kiln.data.stream import Windows
from kiln.data.tokenize import TokenizeOptions, tokenize_to_shards
from kiln.errors import ConfigError
from kiln.models.auto import AutoConfig, from_config
from kiln.train.checkpoint import read_trainer_state
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.data.tokdata import kiln, make_docs, make_tokenizer_dir

TINY_QWEN3 = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
              "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, tok_dir) -> Path:
    d = tmp_path_factory.mktemp("pt")
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(160, 9)))
    tokenize_to_shards([d / "docs.jsonl"], tok_dir, d / "shards",
                       TokenizeOptions(val_fraction=0.1, seed=2, shard_tokens=600, progress=False))
    return d / "shards"


def write_run(path: Path, tok_dir: Path, shards: Path, out_dir: Path, model: dict | None = None, **train) -> Path:
    keys = {"out_dir": str(out_dir), "seed": 1, "steps": 10, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2,
            "save_every": 3, "eval_every": 5, "keep_last": 10, "progress": False, "device": "cpu", **train}
    config = ", ".join(f"{k} = {json.dumps(v)}" for k, v in (model or TINY_QWEN3).items())
    path.write_text(f'[model]\nfamily = "qwen3"\ntask = "causal-lm"\ntokenizer = "{tok_dir}"\nconfig = {{ {config} }}\n\n'
                    f'[data]\ntrain = "{shards}"\neval = "{shards}"\nmax_length = 16\nnum_workers = 2\n'
                    'within_doc = true\n\n[train]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def _curve(run: Path) -> list[tuple]:
    return [tuple(sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))) for r in read_metrics(run / "metrics.jsonl")]


@pytest.mark.slow
def test_kiln_train_sigkilled_and_resumed_reads_the_same_windows(tmp_path, tok_dir, shard_dir):
    ref = tmp_path / "ref"
    kiln("train", "--config", str(write_run(tmp_path / "ref.toml", tok_dir, shard_dir, ref)))
    run = tmp_path / "run"
    cfg = write_run(tmp_path / "run.toml", tok_dir, shard_dir, run)
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:8"}, check=False)   # newest checkpoint: 6
    assert p.returncode == -9, p.stderr
    assert json.loads((run / "run_state.json").read_text())["step"] == 6
    p = kiln("train", "--config", str(cfg), "--resume", str(run))
    assert "from ckpt-000006" in p.stdout

    assert _curve(run) == _curve(ref)      # every step's loss: the same batches, in the same order
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "eval_ppl" in r]) == 2
    a, b = load_file(str(ref / "ckpt-000010/model/model.safetensors")), load_file(str(run / "ckpt-000010/model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((run / "run_state.json").read_text())
    assert state["data"] == read_trainer_state(ref / "ckpt-000010")["data"]
    assert state["data"]["next_window"] == 40 and state["checkpoint"] == "ckpt-000010"


def test_trainer_on_the_stream_learns_and_reports_perplexity(tmp_path, tok_dir, shard_dir):
    cfg = load_run_config(write_run(tmp_path / "run.toml", tok_dir, shard_dir, tmp_path / "run", steps=16,
                                    eval_every=8, save_every=8, lr=1e-2))
    cfg.data.num_workers = 0
    trainer = build_trainer(cfg).fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [8, 16]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] < math.log(300)
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    losses = [r["loss"] for r in records if "loss" in r]
    assert sum(losses[-4:]) < sum(losses[:4]) and all(r["tokens_per_s"] > 0 for r in records if "loss" in r)
    saved = read_trainer_state(tmp_path / "run" / "ckpt-000008")["data"]
    assert saved["next_window"] == 32 and saved["kind"] == "token-stream"
    assert trainer.loader.state_dict()["next_window"] == 64


def test_attention_stays_inside_documents(shard_dir):
    torch.manual_seed(0)
    model = from_config(AutoConfig.for_model("qwen3", **TINY_QWEN3), task="causal-lm", seed=0).eval()
    shards = ShardSet(shard_dir, "train")
    windows = Windows(shards, 63, within_doc=True)
    # a window holding a whole document after the start of another one
    batch = next(b for b in (windows.batch([k]) for k in range(40))
                 if int((b["input_ids"][0] == shards.eos_id).sum()) >= 2)
    x, pos = batch["input_ids"], batch["position_ids"]
    ends = (x[0] == shards.eos_id).nonzero().flatten().tolist()
    a, b = ends[0] + 1, ends[1] + 1          # the second document of the window is x[a:b]
    assert pos[0, a] == 0 and pos[0, b - 1] == b - 1 - a
    with torch.no_grad():
        packed = model(input_ids=x, position_ids=pos).logits[0, a:b]
        alone = model(input_ids=x[:, a:b]).logits[0]
        leaky = model(input_ids=x).logits[0, a:b]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky, alone, atol=1e-3)   # without positions, it sees the previous document


def test_run_with_another_tokenizer_or_too_small_a_vocab_is_refused(tmp_path, tok_dir, shard_dir):
    other = make_tokenizer_dir(tmp_path / "other", vocab_size=280)
    cfg = load_run_config(write_run(tmp_path / "a.toml", other, shard_dir, tmp_path / "a"))
    with pytest.raises(ShardError, match=rf"{shard_dir}/manifest.json: the shards were tokenized with .*bpe .*not with "
                                         rf"the run's tokenizer {other}"):
        build_trainer(cfg)
    cfg = load_run_config(write_run(tmp_path / "b.toml", tok_dir, shard_dir, tmp_path / "b",
                                    model={**TINY_QWEN3, "vocab_size": 200}))
    with pytest.raises(ConfigError, match=r"token ids go up to 299 but the model's vocab_size is 200"):
        build_trainer(cfg)
    cfg.model.task = "masked-lm"
    with pytest.raises(ConfigError, match=r"is a token shard directory, which only model.task = 'causal-lm' reads"):
        build_trainer(cfg)
