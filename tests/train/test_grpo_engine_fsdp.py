"""GRPO's rollouts on the generation engine under FSDP2 (kiln.train.grpo_engine, kiln.parallel.fsdp).

Two gloo processes each: the engine's pieces on an FSDP2-sharded tiny Qwen3 against the same model unsharded
(rollouts, the scoring forward's log-probs and its gradients), and a whole `kiln launch` GRPO run under FSDP2
against the same run under DDP. Under both, a rollout draws the same completions (each micro-batch's seed is
its place in the global batch) on the same weights, and with exact_logprobs the trainer's log-probs are the
engine's bits (logprob_gap 0 at every step).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kiln.train.metrics import read_metrics
from tests.parallel.sft_runs import launch
from tests.spawn import spawn
from tests.train.dpo_helpers import QWEN3, arithmetic_pairs, make_tokenizer, write_jsonl

LOW = 100
REWARD = f"""
def share_low(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t < {LOW}) / max(len(ids), 1) for ids in completion_ids]
"""


def _pieces(rank: int, world: int, out: str) -> None:
    """One rank: rollouts, log-probs and gradients of the FSDP2 model against its unsharded copy's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import kiln.engine  # noqa: F401  (the runners' registry)
    from kiln.models.auto import AutoConfig, from_config
    from kiln.parallel.fsdp import apply_fsdp, units
    from kiln.train.grpo_engine import EngineRollouts, exact_logps, exact_refusal, fits, refusal

    model = from_config(AutoConfig.for_model("qwen3", **QWEN3), task="causal-lm", seed=0)
    plain = copy.deepcopy(model)
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    report: dict = {"refusal": refusal(model), "exact_refusal": exact_refusal(model), "fits": fits(model)}
    settings = type("G", (), dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, temperature=0.7))
    prompts = [[5, 6, 7, 8 + rank], [9, 10, 11]]  # each rank its own prompts
    outs = []
    for m in (model, plain):
        with torch.no_grad():
            outs.append(EngineRollouts(settings).run(m, prompts, [6, 6], 2, torch.Generator().manual_seed(3),
                                                     [QWEN3["eos_token_id"]]))
    report["rollouts_equal"] = outs[0] == outs[1]
    report["sharded_after"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    report["classes_back"] = len(units(model)) == QWEN3["num_hidden_layers"] + 1
    tokens, logps, _ = outs[0][0][1]
    ids = torch.tensor([prompts[0] + tokens])
    micro = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt_len": len(prompts[0]),
             "completion_mask": torch.ones(1, len(tokens), dtype=torch.long)}
    sharded, whole = exact_logps(model, micro, 0.7), exact_logps(plain, micro, 0.7)
    report["logps_equal"] = torch.equal(sharded, whole)
    report["logps_are_rollouts"] = torch.equal(sharded[0], torch.tensor(logps))
    (sharded * torch.arange(1.0, len(tokens) + 1)).sum().backward()
    (whole * torch.arange(1.0, len(tokens) + 1)).sum().backward()
    worst = 0.0
    for p, q in zip(model.parameters(), plain.parameters()):
        mean = q.grad.clone()
        dist.all_reduce(mean)
        worst = max(worst, float((p.grad.full_tensor() - mean / world).abs().max() / mean.abs().max().clamp(min=1e-12)))
    report["grad_rel_err"] = worst
    torch.save(report, f"{out}/rank{rank}.pt")


def test_engine_runs_fsdp2_model(tmp_path):
    spawn(_pieces, 2, (str(tmp_path),), preload=("torch", "torch.distributed.tensor", "kiln.parallel.apply",
                                                 "kiln.train.grpo_engine"))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert r["refusal"] is None and r["exact_refusal"] is None and r["fits"] is None, r
        assert r["rollouts_equal"], rank  # tokens and log-probs, each rank its own prompts
        assert r["sharded_after"] and r["classes_back"], r
        assert r["logps_equal"] and r["logps_are_rollouts"], r
        # the sharded backward's gradients are the whole model's averaged over ranks: fp32 sums in another
        # order (a reduce-scatter of two ranks' halves against an all-reduce), ~1e-7 relative
        assert r["grad_rel_err"] < 1e-5, r


# ---- a whole run: FSDP2 against DDP -------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("grpo-engine-fsdp")
    rows = arithmetic_pairs(16)
    make_tokenizer(d, rows)
    write_jsonl(d / "prompts.jsonl", [{"prompt": r["prompt"][0]["content"]} for r in rows])
    (d / "fsdp_rewards.py").write_text(REWARD)
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    model = from_config(AutoConfig.for_model("qwen3", **QWEN3), task="causal-lm", seed=0)
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    model.save_pretrained(d / "model")  # read from model.path: under FSDP2 each rank reads its share
    return d


def _toml(d: Path, name: str, fsdp: bool) -> Path:
    path = d / f"{name}.toml"
    path.write_text(f"""
[model]
path = "{d / 'model'}"
task = "causal-lm"
[data]
train = "{d / 'prompts.jsonl'}"
max_length = 40
[train]
out_dir = "{d / name}"
seed = 3
steps = 3
batch_size = 2
lr = 2e-2
weight_decay = 0.0
schedule = "constant"
progress = false
save_at_end = false
[grpo]
rewards = ["fsdp_rewards:share_low"]
num_generations = 4
max_new_tokens = 6
temperature = 0.9
beta = 0.05
loss_type = "grpo"
exact_logprobs = true
{"[parallel]" + chr(10) + "fsdp = true" if fsdp else ""}
""")
    return path


@pytest.mark.slow  # two `kiln launch` runs: ~55 s on two loaded cores
def test_fsdp2_grpo_on_the_engine_equals_ddp(data):
    fsdp = launch(_toml(data, "fsdp", fsdp=True))
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "(FSDP)" in fsdp.stdout
    assert "[grpo] rollouts on the generation engine under FSDP2" in fsdp.stdout
    assert "generate loop" not in fsdp.stdout and "exact_logprobs:" not in fsdp.stdout
    ddp = launch(_toml(data, "ddp", fsdp=False))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "generate loop" not in ddp.stdout
    keys = ("loss", "reward", "kl", "completion_length", "logprob_gap")
    runs = {}
    for name in ("fsdp", "ddp"):
        rows = [r for r in read_metrics(data / name / "metrics.jsonl") if "loss" in r]
        assert len(rows) == 3, name
        runs[name] = {k: [r[k] for r in rows] for k in keys}
        assert runs[name]["logprob_gap"] == [0.0, 0.0, 0.0], name  # the trainer's log-probs are the engine's bits
    assert runs["fsdp"]["loss"][0] != runs["fsdp"]["loss"][-1]  # it learns: a curve, not a constant
    for k in keys:
        # the same completions (same seeds, same weights); the gradients' fp32 sums in another order (a
        # reduce-scatter against DDP's all-reduce), ~1e-7 relative a step, grown by AdamW over 3 steps: the
        # tolerance of the SFT plans' test
        torch.testing.assert_close(torch.tensor(runs["fsdp"][k]), torch.tensor(runs["ddp"][k]), rtol=1e-5,
                                   atol=1e-6, msg=k)
