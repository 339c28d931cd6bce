"""Raw token ids as pre-training data (kiln.data.raw): a flat .bin file and a folder of .npy shards train and
resume exactly after a SIGKILL; out-of-vocabulary ids and odd dtypes are refused naming the file; val_fraction
holds out the tail (or whole shards); train.eval_batches caps an evaluation; nothing is written beside the data."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from kiln.data.raw import RawTokens, raw_files
from kiln.data.shards import ShardError
from kiln.errors import KilnError
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.train_helpers import TINY_QWEN3_TOML, killed_then_resumed_matches

VOCAB = 64


def _ids(n: int, seed: int) -> np.ndarray:
    """A learnable stream: runs counting up by one, restarting at random points."""
    rng = np.random.default_rng(seed)
    out, x = np.empty(n, dtype=np.int64), 1
    for i in range(n):
        x = int(rng.integers(1, VOCAB)) if rng.random() < 0.1 else (x % (VOCAB - 1)) + 1
        out[i] = x
    return out


def _toml(path: Path, train: Path, out_dir: Path, data: str = "", train_keys: str = "", steps: int = 8,
          vocab: bool = True) -> Path:
    """A tiny Qwen3 pre-training run on raw token data; `vocab=False` leaves the vocabulary to be inferred."""
    path.write_text(f"""[model]
family = "qwen3"
task = "causal-lm"
[model.config]
{f"vocab_size = {VOCAB}" if vocab else ""}
{TINY_QWEN3_TOML}eos_token_id = 0
[data]
train = "{train}"
max_length = 16
{data}
[train]
out_dir = "{out_dir}"
seed = 1
steps = {steps}
batch_size = 4
lr = 1e-2
save_every = 2
eval_every = 4
keep_last = 10
progress = false
{train_keys}
""")
    return path


def _snapshot(folder: Path) -> dict:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    (d / "flat").mkdir()
    _ids(3000, 1).astype(np.uint16).tofile(d / "flat" / "ids.bin")
    (d / "shards").mkdir()
    for i in range(4):
        np.save(d / "shards" / f"part-{i}.npy", _ids(700, 10 + i).astype(np.int32))
    return d


def test_reading_splits_and_refusals(raw_data, tmp_path):
    flat = raw_files(raw_data / "flat" / "ids.bin")
    train = RawTokens(flat, "train", VOCAB, 0, "uint16", val_fraction=0.1)
    val = RawTokens(flat, "val", VOCAB, 0, "uint16", val_fraction=0.1)
    assert (train.total_tokens, val.total_tokens) == (2700, 300)
    whole = np.fromfile(raw_data / "flat" / "ids.bin", dtype=np.uint16)
    assert np.array_equal(np.concatenate([train.tokens(0), val.tokens(0)]), whole)  # the tail, in order
    shards = raw_files(raw_data / "shards", ".npy")
    assert [p.name for p in RawTokens(shards, "val", VOCAB, 0, val_fraction=0.25).paths] == ["part-3.npy"]

    bad = tmp_path / "bad.npy"
    ids = _ids(100, 3)
    ids[57] = VOCAB + 5
    np.save(bad, ids)
    with pytest.raises(ShardError, match=rf"bad.npy: token id {VOCAB + 5} at position 57 is outside the model's "
                                         rf"vocabulary \(0..{VOCAB - 1}\)"):
        RawTokens([bad], "train", VOCAB, 0)
    for dtype in ("float32", "int8"):
        np.save(tmp_path / f"{dtype}.npy", np.ones(50, dtype=dtype))
        with pytest.raises(ShardError, match=rf"{dtype}.npy: token ids of dtype {dtype} are not read"):
            RawTokens([tmp_path / f"{dtype}.npy"], "train", VOCAB, 0)
    with pytest.raises(ShardError, match=r"ids.bin: a .bin file has no header; set data.dtype"):
        RawTokens(flat, "train", VOCAB, 0)


def test_out_of_vocab_file_stops_kiln_train_by_name(raw_data, tmp_path):
    np.save(tmp_path / "big.npy", np.full(200, VOCAB, dtype=np.int64))
    cfg = load_run_config(_toml(tmp_path / "r.toml", tmp_path / "big.npy", tmp_path / "out", steps=2))
    with pytest.raises(KilnError, match=rf"big.npy: token id {VOCAB} at position 0 is outside"):
        build_trainer(cfg)


def test_eval_batches_caps_the_held_out_pass(raw_data, tmp_path):
    before = _snapshot(raw_data / "flat")
    cfg = load_run_config(_toml(tmp_path / "r.toml", raw_data / "flat" / "ids.bin", tmp_path / "out",
                                'dtype = "uint16"\nval_fraction = 0.5', "eval_batches = 1", steps=4))
    build_trainer(cfg).fit()
    evals = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 1 and evals[0]["eval_loss"] > 0
    assert _snapshot(raw_data / "flat") == before  # nothing written beside the data


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "shards"])
def test_sigkill_then_resume_is_exact(raw_data, tmp_path, kind):
    train, data = ((raw_data / "flat" / "ids.bin", 'dtype = "uint16"\nval_fraction = 0.1') if kind == "flat"
                   else (raw_data / "shards", 'extension = ".npy"\nval_fraction = 0.25'))
    before = _snapshot(train.parent if kind == "flat" else train)
    killed_then_resumed_matches(_toml(tmp_path / "ref.toml", train, tmp_path / "ref", data),
                                _toml(tmp_path / "run.toml", train, tmp_path / "run", data))  # newest ckpt: 4
    assert any("eval_loss" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert _snapshot(train.parent if kind == "flat" else train) == before
