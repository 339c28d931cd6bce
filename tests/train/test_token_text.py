"""Token text files (whitespace-separated integer ids, the seed research trainer's input) as pre-training
data: a flat .txt file and a folder of .txt shards train and resume exactly after a SIGKILL; a bad token is
named by file:line; a from-scratch model's vocabulary is inferred from the data (max id + 1) and stated;
data.shuffle_shards = false reads the shards in their sorted order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.data.raw import RawTokens, raw_files
from kiln.data.shards import ShardError
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.test_raw_tokens import VOCAB, _ids, _snapshot, _toml
from tests.train.train_helpers import killed_then_resumed_matches


def _write(path: Path, ids: np.ndarray, per_line: int = 13) -> Path:
    path.write_text("\n".join(" ".join(map(str, ids[i:i + per_line])) for i in range(0, len(ids), per_line)) + "\n")
    return path


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    (d / "flat").mkdir()
    _write(d / "flat" / "ids.txt", _ids(3000, 1))
    (d / "shards").mkdir()
    for i in range(4):
        _write(d / "shards" / f"part-{i}.txt", _ids(700, 10 + i))
    return d


def test_token_text_reads_as_its_ids_and_a_bad_token_names_file_and_line(text_data, tmp_path):
    ids = RawTokens(raw_files(text_data / "flat" / "ids.txt"), "train", VOCAB, 0)
    assert np.array_equal(ids.tokens(0), _ids(3000, 1))
    shards = raw_files(text_data / "shards", ".txt")
    assert [p.name for p in shards] == [f"part-{i}.txt" for i in range(4)]
    for text, line, token in (("1 2 3\n4 5 x7\n8\n", 2, "x7"), ("1 2\n\n3 -4 5\n", 3, "-4"), ("7 2.5\n", 1, "2.5")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ShardError, match=rf"bad.txt:{line}: '{token}' is not a token id"):
            RawTokens([bad], "train", VOCAB, 0)
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(ShardError, match="empty.txt: the token text file holds no token ids"):
        RawTokens([tmp_path / "empty.txt"], "train", VOCAB, 0)


def test_vocabulary_is_inferred_from_the_data_and_stated(text_data, tmp_path, capsys):
    train = text_data / "flat" / "ids.txt"
    trainer = build_trainer(load_run_config(_toml(tmp_path / "r.toml", train, tmp_path / "out", "val_fraction = 0.1",
                                                  vocab=False)))
    top = int(_ids(3000, 1).max())
    assert trainer._model_arg.config.vocab_size == top + 1  # the model, as build_trainer hands it over
    assert f"vocab_size = {top + 1}, inferred from the data" in capsys.readouterr().out
    # a vocab_size in the config wins
    trainer = build_trainer(load_run_config(_toml(tmp_path / "s.toml", train, tmp_path / "out2", "val_fraction = 0.1")))
    assert "inferred from the data" not in capsys.readouterr().out


def test_shuffle_shards_false_reads_the_shards_in_sorted_order(text_data, tmp_path):
    for shuffle, want_sorted in (("false", True), ("true", False)):
        cfg = load_run_config(_toml(tmp_path / f"{shuffle}.toml", text_data / "shards", tmp_path / shuffle,
                                    f'extension = ".txt"\nshuffle_shards = {shuffle}'))
        windows = build_trainer(cfg).data.windows
        orders = [windows.order(e).tolist() for e in range(4)]
        # seeded permutations of 4 shards: 4 epochs all in sorted order by chance has probability (1/24)^4
        assert all(o == [0, 1, 2, 3] for o in orders) == want_sorted, orders


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "shards"])
def test_token_text_sigkill_then_resume_is_exact(text_data, tmp_path, kind):
    train, data = ((text_data / "flat" / "ids.txt", "val_fraction = 0.1") if kind == "flat"
                   else (text_data / "shards", 'extension = ".txt"\nval_fraction = 0.25'))
    before = _snapshot(train.parent if kind == "flat" else train)
    killed_then_resumed_matches(_toml(tmp_path / "ref.toml", train, tmp_path / "ref", data, vocab=False),
                                _toml(tmp_path / "run.toml", train, tmp_path / "run", data, vocab=False))  # newest ckpt: 4
    assert any("eval_loss" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert _snapshot(train.parent if kind == "flat" else train) == before
