"""The bad cases of the fourth fault sweep (issue 41), each held through the CLI or the server where the user meets
it: the message, the exit code or HTTP status, no traceback, nothing under the inputs changed. Before: a GRPO run whose
reward functions returned None for every completion warned, then ended "done" (exit 0) having learned nothing;
`[grpo] max_new_tokens = 100000` on a 64-position model was accepted and its truncation alarm advised raising it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.bad_inputs_world import write_toml
from tests.cli.reliability_world import run_cli, snapshot

TINY = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
        "pad_token_id": 0, "eos_token_id": 2}


@pytest.fixture(scope="module")
def grpo_inputs(tmp_path_factory) -> Path:
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("grpo")
    rows = [{"prompt": f"what is {a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "text.jsonl").write_text("".join(json.dumps({"text": f"{r['prompt']} {r['answer']}"}) + "\n" for r in rows))
    train_bpe([d / "text.jsonl"], d / "tok", vocab_size=300, min_frequency=1)
    (d / "rw.py").write_text("def nothing(prompts, completions, **columns):\n    return [None] * len(completions)\n\n"
                             "def length(prompts, completion_ids, **columns):\n"
                             "    return [float(len(c)) for c in completion_ids]\n")
    return d


def grpo_config(d: Path, out: Path, reward: str, steps: int, **grpo) -> Path:
    return write_toml(d / f"{out.name}.toml", {
        "model": {"family": "qwen3", "task": "causal-lm", "tokenizer": "tok", "config": TINY},
        "data": {"train": "prompts.jsonl", "max_length": 32},
        "train": {"out_dir": out, "steps": steps, "batch_size": 2, "progress": False, "device": "cpu"},
        "grpo": {"rewards": [f"rw:{reward}"], "num_generations": 2, "max_new_tokens": 4, **grpo}})


@pytest.mark.parametrize("steps,stop", [(5, 3), (2, 2)])
def test_a_grpo_run_with_no_reward_at_all_is_refused(grpo_inputs, tmp_path, steps, stop):
    """Every reward None in the first 3 rollouts (or in all of a shorter run): stopped, exit 1, no checkpoint."""
    cfg = grpo_config(grpo_inputs, tmp_path / f"none{steps}", "nothing", steps)
    before = snapshot(grpo_inputs)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "Traceback" not in out, out
    assert ("[grpo] nothing can be learned: every reward function (nothing) returned None for every completion of "
            f"the first {stop} rollout(s) (up to step {stop})") in out, out
    assert "done:" not in out and out.count("alarm/none_rewards") == 1, out
    assert not list((tmp_path / f"none{steps}").glob("ckpt-*"))
    assert snapshot(grpo_inputs) == before


def test_a_grpo_run_with_rewards_counts_its_groups_with_signal(grpo_inputs, tmp_path):
    cfg = grpo_config(grpo_inputs, tmp_path / "scored", "length", 1)
    code, out = run_cli("train", "--config", cfg)
    assert code == 0 and "done: step 1" in out and "nothing can be learned" not in out, out
    rows = [json.loads(x) for x in (tmp_path / "scored" / "metrics.jsonl").read_text().splitlines()]
    assert any("groups_with_signal" in r for r in rows), rows


def test_grpo_max_new_tokens_past_the_model_positions_is_refused_before_any_work(grpo_inputs, tmp_path):
    cfg = grpo_config(grpo_inputs, tmp_path / "long", "length", 1, max_new_tokens=100000)
    before = snapshot(grpo_inputs)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "Traceback" not in out, out
    assert "grpo.max_new_tokens = 100000: the longest prompt (" in out, out
    assert "+ 100000 = " in out and "over the model's max_position_embeddings = 64; set grpo.max_new_tokens <=" in out
    assert not (tmp_path / "long").exists() and snapshot(grpo_inputs) == before
