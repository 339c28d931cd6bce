"""Nothing to learn is said (issue 41, class 6): DPO pairs with chosen = rejected (every row, or all empty) are
refused when every pair is so and counted in a warning when some are; MNRL rows that all share one positive (one
row at batch size 1 included) are refused, repeated positives counted. Each refusal asserts the message, exit 1
and that nothing in the case's folder changed."""

from __future__ import annotations

import json

import pytest

from tests.cli.bad_inputs_world import write_toml
from tests.cli.reliability_world import run_cli, snapshot
from tests.train.dpo_helpers import QWEN3, make_tokenizer, standard_pairs, write_jsonl


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("signal")
    return d, make_tokenizer(d, standard_pairs(8))


def _dpo(d, tok, name: str, rows: list[dict], loss_type: str = "sigmoid"):
    write_jsonl(d / f"{name}.jsonl", rows)
    return write_toml(d / f"{name}.toml", {
        "model": {"family": "qwen3", "task": "causal-lm", "tokenizer": tok, "config": QWEN3},
        "data": {"train": d / f"{name}.jsonl", "max_length": 48},
        "train": {"out_dir": d / "runs" / name, "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"},
        "dpo": {"loss_type": loss_type}})


@pytest.mark.parametrize("rows,loss", [
    ([{"prompt": "what is 2 plus 2?", "chosen": " It is 4.", "rejected": " It is 4."}] * 4, "sigmoid"),
    ([{"prompt": "hi", "chosen": "", "rejected": ""}] * 4, "ipo"),
    ([{"prompt": "what is 2 plus 2?", "chosen": " It is 4.", "rejected": " It is 4."}] * 4, "simpo"),
], ids=["identical-sigmoid", "empty-ipo", "identical-simpo"])
def test_dpo_with_no_preference_in_any_pair_is_refused(world, rows, loss):
    d, tok = world
    cfg = _dpo(d, tok, f"same-{loss}", rows, loss)
    before = snapshot(d)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1, out
    assert "every one of its 4 preference pairs has chosen = rejected" in out and repr(loss) in out, out
    assert snapshot(d) == before and not (d / "runs" / f"same-{loss}").exists()


def test_dpo_some_identical_pairs_are_counted_once_and_orpo_still_learns(world):
    d, tok = world
    good = standard_pairs(6)
    same = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["chosen"]} for r in good[:2]]
    code, out = run_cli("train", "--config", _dpo(d, tok, "some", good + same))
    assert code == 0, out
    assert out.count("2 of 8 preference pairs have chosen = rejected and carry no preference signal; 6 carry "
                     "signal") == 1, out
    assert "8 preference pairs; 0 dropped" in out and "; 2 with chosen = rejected (no signal)" in out, out
    # ORPO learns the chosen reply even from a pair without a preference: said, not refused
    code, out = run_cli("train", "--config", _dpo(d, tok, "orpo", same * 2, "orpo"))
    assert code == 0, out
    assert "only the chosen reply is learned from them" in out, out


def _mnrl(d, name: str, rows: list[dict], batch_size: int, tiny) -> str:
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_toml(d / f"{name}.toml", {
        "model": {"path": tiny, "task": "sentence-embedding"},
        "data": {"train": d / f"{name}.jsonl", "max_length": 16}, "embedding": {"loss": "mnrl"},
        "train": {"out_dir": d / "runs" / name, "steps": 1, "batch_size": batch_size, "progress": False,
                  "device": "cpu"}})


@pytest.mark.parametrize("rows,batch,says", [
    ([{"anchor": "a cat", "positive": "the cat sat"}], 1, "its one row"),
    ([{"anchor": "a cat", "positive": "the cat sat"}] * 4, 2, "all 4 rows share one positive"),
    ([{"anchor": f"cat {i}", "positive": "the cat sat"} for i in range(4)], 4, "all 4 rows share one positive"),
], ids=["one-row-batch-1", "duplicate-pairs", "one-positive"])
def test_mnrl_without_negatives_to_tell_is_refused(tmp_path, tiny_factory, rows, batch, says):
    cfg = _mnrl(tmp_path, "m", rows, batch, tiny_factory("bert", "masked-lm"))
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and says in out and "has no other positive to tell it from" in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "runs").exists()


def test_mnrl_repeated_positives_are_counted_and_a_hard_negative_is_signal(tmp_path, tiny_factory):
    tiny = tiny_factory("bert", "masked-lm")
    rows = [{"anchor": f"cat {i}", "positive": f"the cat sat {i % 3}"} for i in range(6)]
    code, out = run_cli("train", "--config", _mnrl(tmp_path, "rep", rows, 2, tiny))
    assert code == 0, out
    assert "3 of 6 rows repeat another row's positive" in out, out
    one = [{"anchor": "a cat", "positive": "the cat sat", "negative": "a dog ran"}]
    code, out = run_cli("train", "--config", _mnrl(tmp_path, "neg", one, 1, tiny))
    assert code == 0, out
