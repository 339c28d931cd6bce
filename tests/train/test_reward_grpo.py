"""A reward model trained by kiln drives a GRPO run: `load_reward` over the reward-model run, called from a reward
module (`grpo.rewards = ["myrm:rm"]`, how a module reaches it until grpo.rewards reads "model:DIR" itself), and the
policy's mean reward under it rises."""

from __future__ import annotations

import json
import random

import pytest

from kiln.train import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.dpo_helpers import QWEN3, standard_pairs, write_jsonl

RM_MODULE = '''
from kiln.train.reward_model import load_reward

_fn = None


def rm(prompts, completions, completion_ids, **columns):
    global _fn
    if _fn is None:  # read once, on first use: the reward model run's newest checkpoint
        _fn = load_reward({run!r}, device="cpu", batch_size=8)
    return _fn(prompts, completions)
'''


@pytest.mark.slow  # two training runs (the reward model, then GRPO under it)
def test_grpo_reward_from_a_kiln_reward_model_rises(tmp_path):
    from kiln.data.bpe import train_bpe

    # the preference a tiny random policy can find: replies of fruit words over replies of stone words
    rng = random.Random(0)
    good, bad = ["apple", "pear", "plum", "fig", "lime"], ["rock", "stone", "sand", "clay", "slate"]
    pairs = [{"prompt": r["prompt"], "chosen": " " + " ".join(rng.choices(good, k=rng.randint(1, 4))),
              "rejected": " " + " ".join(rng.choices(bad, k=rng.randint(1, 4)))} for r in standard_pairs(96)]
    rows = [{"prompt": r["prompt"]} for r in pairs]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    write_jsonl(tmp_path / "text.jsonl", [{"text": r["prompt"] + r["chosen"] + r["rejected"]} for r in pairs])
    train_bpe([tmp_path / "text.jsonl"], tmp_path / "tok", vocab_size=300, min_frequency=1)
    config = "\n".join(f"{k} = {v}" for k, v in QWEN3.items())
    (tmp_path / "rm.toml").write_text(f"""[model]
family = "qwen3"
task = "reward-model"
tokenizer = "tok"
[model.config]
{config}
[data]
train = "pairs.jsonl"
max_length = 48
[train]
out_dir = "{tmp_path / 'rm'}"
steps = 24
batch_size = 8
lr = 3e-3
weight_decay = 0.0
progress = false
save_every = 24
""")
    build_trainer(load_run_config(tmp_path / "rm.toml")).fit()
    (tmp_path / "myrm.py").write_text(RM_MODULE.format(run=str(tmp_path / "rm")))
    (tmp_path / "grpo.toml").write_text(f"""[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "tok"
init_seed = 3
[model.config]
{config}
[data]
train = "prompts.jsonl"
max_length = 32
[train]
out_dir = "{tmp_path / 'grpo'}"
steps = 20
batch_size = 2
lr = 5e-2
weight_decay = 0.0
schedule = "constant"
progress = false
[grpo]
rewards = ["myrm:rm"]
num_generations = 4
max_new_tokens = 6
loss_type = "grpo"
""")
    build_trainer(load_run_config(tmp_path / "grpo.toml")).fit()
    records = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    rewards = [r["reward"] for r in records]
    spread = sum(r["reward_std"] for r in records[:3]) / 3
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"GRPO reward under the reward model: {first:.3f} -> {last:.3f} (first steps' reward_std {spread:.3f})")
    # a step's mean over 8 completions has a standard error of ~reward_std / 2.8, a mean of three steps ~/4.9:
    # a rise of one reward_std is ~5 of those
    assert spread > 0 and last > first + spread, (rewards, spread)
    assert {"reward/rm"} <= set(records[0])
    json.dumps(records)  # the metrics are plain numbers
