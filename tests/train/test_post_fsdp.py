"""[dpo] and [grpo] under FSDP2 (`kiln launch`, 2 gloo processes, parallel.fsdp): the loss curve equals one
process's on the same global batch (one process: 2 micro-batches of grad_accum; FSDP: one per rank).

Both exercise the parts FSDP2 could break: the policy's log-probs reach the sharded LM head through the
model's own `token_logps` (registered as a forward, so the head is gathered), and the frozen reference copy
of the starting weights is sharded like the policy. GRPO also samples through the sharded model (on the
generation engine, the weights gathered for the rollout) and with beta > 0 takes the KL to the sharded reference; its sampling seeds depend on
the micro-batch's place in the global batch, so both runs draw the same completions. GRPO's runs read the model
from model.path: under FSDP2 its reference is a copy of a model built on meta, which reads its own shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.train import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.parallel.sft_runs import launch
from tests.train.dpo_helpers import arithmetic_pairs, make_tokenizer, model_section, write_jsonl

LOW = 100
REWARD = f"""
def share_low(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t < {LOW}) / max(len(ids), 1) for ids in completion_ids]
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("post-fsdp")
    rows = arithmetic_pairs(16)
    write_jsonl(d / "pairs.jsonl", rows)
    make_tokenizer(d, rows)
    write_jsonl(d / "prompts.jsonl", [{"prompt": r["prompt"][0]["content"]} for r in rows])
    (d / "fsdp_rewards.py").write_text(REWARD)
    return d


def _saved_model(d: Path) -> Path:
    """model_section's tiny Qwen3 saved as an HF directory: GRPO's runs read it from model.path, so under FSDP2 the
    policy and the reference copy of it are built on meta and each rank reads its share (kiln.parallel.sharded_load)."""
    out = d / "model"
    if not out.exists():
        from kiln.hub import Tokenizer
        from kiln.models.auto import AutoConfig, from_config
        from tests.train.dpo_helpers import QWEN3

        model = from_config(AutoConfig.for_model("qwen3", **QWEN3), task="causal-lm", seed=0)
        model.tokenizer = Tokenizer.from_dir(d / "tok")
        model.save_pretrained(out)
    return out


def _toml(d: Path, name: str, table: str, fsdp: bool) -> Path:
    # GRPO rolls out on the generation engine in both (under FSDP2 on the gathered weights: engfsdp), so both
    # draw the same completions
    train, section = ("pairs.jsonl", "[dpo]\nbeta = 0.1") if table == "dpo" else (
        "prompts.jsonl", '[grpo]\nrewards = ["fsdp_rewards:share_low"]\nnum_generations = 4\nmax_new_tokens = 5\n'
                         'beta = 0.05\nloss_type = "grpo"')
    model = model_section(d) if table == "dpo" else f'[model]\npath = "{_saved_model(d)}"\ntask = "causal-lm"\n'
    path = d / f"{name}.toml"
    path.write_text(f"""
{model}[data]
train = "{d / train}"
max_length = 40
[train]
out_dir = "{d / name}"
seed = 3
steps = 3
batch_size = 2
grad_accum = {1 if fsdp else 2}
lr = 2e-2
weight_decay = 0.0
schedule = "constant"
progress = false
save_at_end = false
{section}
{"[parallel]" + chr(10) + "fsdp = true" if fsdp else ""}
""")
    return path


def _curve(run: Path, keys: tuple[str, ...]) -> dict[str, list[float]]:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    return {k: [r[k] for r in rows] for k in keys}


@pytest.mark.slow
@pytest.mark.parametrize("table, keys", [
    ("dpo", ("loss", "rewards/margins", "logps/chosen")),
    ("grpo", ("loss", "reward", "kl", "completion_length")),
])
def test_fsdp_two_processes_equal_one_process(data, table, keys):
    build_trainer(load_run_config(_toml(data, f"{table}-one", table, fsdp=False))).fit()
    p = launch(_toml(data, f"{table}-fsdp", table, fsdp=True))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(FSDP)" in p.stdout
    if table == "grpo":
        assert "[grpo] rollouts on the generation engine under FSDP2" in p.stdout  # engfsdp
    one, two = _curve(data / f"{table}-one", keys), _curve(data / f"{table}-fsdp", keys)
    assert len(one["loss"]) == 3
    assert one["loss"][0] != one["loss"][-1]  # the runs learn: a curve, not a constant
    for k in keys:
        # fp32 sums in another order (two ranks' halves, reduce-scattered gradients): ~1e-7 relative per step,
        # grown by AdamW over 3 steps; the tolerance of the SFT plans' test
        torch.testing.assert_close(torch.tensor(two[k]), torch.tensor(one[k]), rtol=1e-5, atol=1e-6, msg=k)
