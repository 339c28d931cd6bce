"""Samples with signal, step by step (issue 41): DPO's and reward models' `pairs_with_signal` (chosen != rejected),
KTO's `rows_with_signal` (a completion token within max_length: every row, as empty completions are refused), GRPO's `groups_with_signal` (rewards
that differ within the group) in every step's record, counted on the data; a step where none carried signal warned
once per run; and a KTO reference of a smaller vocabulary than the tokenizer refused before training, naming both
sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.preference import Signal, differing_pairs
from kiln.train.run import build_trainer
from tests.train import test_dpo_train, test_kto, test_reward_model
from tests.train.dpo_helpers import arithmetic_pairs, make_tokenizer, write_jsonl
from tests.train.test_grpo_recipe import _toml, grpo_dir  # noqa: F401 (grpo_dir: a fixture)
from tests.train.test_kto import rows_dir  # noqa: F401 (rows_dir: a fixture)

SAME = (1, 4, 6)  # the pairs made identical (chosen = rejected) out of 8


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("signal")
    rows = arithmetic_pairs(8)
    for i in SAME:
        rows[i]["rejected"] = rows[i]["chosen"]
    write_jsonl(d / "train.jsonl", rows)
    write_jsonl(d / "eval.jsonl", arithmetic_pairs(4, 9))
    make_tokenizer(d, arithmetic_pairs(48))
    return d


def test_differing_pairs_and_one_warning():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8], [5, 6, 0, 0]])
    batch = {"chosen_ids": ids, "chosen_len": torch.tensor([3, 4, 2]),
             "rejected_ids": torch.tensor([[5, 6, 7], [5, 6, 9], [5, 6, 0]]), "rejected_len": torch.tensor([3, 3, 2])}
    assert differing_pairs(batch).tolist() == [False, True, False]  # equal / other length and token / equal
    s = Signal("pairs", "chosen = rejected")
    assert s.check(2, 3, 1, False) is None and s.check(0, 0, 2, False) is None  # some signal; nothing seen
    line = s.check(0, 3, 3, False)
    assert line is not None and "step 3: none of its 3 pairs carried a learning signal" in line
    assert s.check(0, 3, 4, False) is None  # once per run


def _records(path: Path) -> list[dict]:
    build_trainer(load_run_config(path)).fit()
    return [r for r in read_metrics(path.parent / path.stem / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("recipe", ["dpo", "reward-model"])
def test_pairs_with_signal_counted_every_step(mixed, recipe):
    """One epoch of 8 pairs in 2 steps of 4: the steps' counts add up to the 5 pairs whose sides differ."""
    if recipe == "dpo":
        path = test_dpo_train.run_toml(mixed, "dpo", steps=2)
    else:
        path = test_reward_model.run_toml(mixed, "rm", steps=2)
    rows = _records(path)
    assert len(rows) == 2 and all(0 <= r["pairs_with_signal"] <= 4 for r in rows)
    assert sum(r["pairs_with_signal"] for r in rows) == 8 - len(SAME)


def test_kto_rows_with_signal_counted_every_step(rows_dir, capsys):
    rows = _records(test_kto.run_toml(rows_dir, "kto-signal", steps=2))
    assert [r["rows_with_signal"] for r in rows] == [8, 8]  # batch 8: every row scores its completion
    assert "carried a learning signal" not in capsys.readouterr().out


def test_grpo_groups_with_signal_and_a_flat_reward_warned_once(grpo_dir, capsys):
    (grpo_dir / "flat.py").write_text("def flat(prompts, completions, **columns):\n"
                                      "    return [1.0] * len(completions)\n")
    capsys.readouterr()
    path = _toml(grpo_dir, "flat", steps=2, grpo="")
    path.write_text(path.read_text().replace('rewards = ["myrewards:share_low"]', 'rewards = ["flat:flat"]'))
    rows = _records_grpo(path)
    assert [r["groups_with_signal"] for r in rows] == [0, 0]
    out = capsys.readouterr().out
    assert out.count("carried a learning signal") == 1 and "none of its 2 groups" in out, out
    learn = _records_grpo(_toml(grpo_dir, "some-signal", steps=1))  # the control: share_low's rewards differ
    assert learn[0]["groups_with_signal"] > 0


def _records_grpo(path: Path) -> list[dict]:
    build_trainer(load_run_config(path)).fit()
    return [r for r in read_metrics(path.parent / path.stem / "metrics.jsonl") if "reward" in r]


def test_a_kto_reference_of_a_smaller_vocabulary_is_refused_before_training(rows_dir, tmp_path):
    import transformers

    from tests.train.dpo_helpers import QWEN3

    small = tmp_path / "small"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, "vocab_size": 120})).save_pretrained(small)
    path = test_kto.run_toml(rows_dir, "kto-ref", f'reference = "{small}"')
    with pytest.raises(ConfigError, match=rf"kto.reference {small}: its vocab_size is 120 but the tokenizer has "
                                          r"\d+ tokens"):
        build_trainer(load_run_config(path))
    assert not (rows_dir / "kto-ref").exists()
