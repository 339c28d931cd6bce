"""[grpo] runs end to end on a tiny Qwen3: mean reward rises on a task it can learn (a reward module beside the
TOML), logprob_gap is 0 at every step on engine rollouts (and within 1e-5, not 0, through the training forward or
kiln's earlier loop), the KL to the reference starts at 0
(frozen copy, and under [lora] the base with the adapters off), bad input is refused by message (naming the
function and the row), and a run SIGKILLed mid-rollout resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.errors import ConfigError, KilnError
from kiln.train import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.kiln_cli import kiln
from tests.train.train_helpers import write_sum_prompts

LOW = 100  # the learnable reward: the share of completion tokens with an id below this (a third of the vocabulary)

REWARDS = f'''
def share_low(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t < {LOW}) / max(len(ids), 1) for ids in completion_ids]

def boom(prompts, completions, **columns):
    raise RuntimeError("no score for you")

def short(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)

def nan_on_second(prompts, completions, **columns):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]

def by_level(prompts, completions, level, **columns):
    return [float(x) for x in level]
'''


@pytest.fixture(scope="module")
def grpo_dir(tmp_path_factory) -> Path:
    return write_sum_prompts(tmp_path_factory.mktemp("grpo"), 6, {"myrewards.py": REWARDS})


def _toml(d: Path, name: str, grpo: str = "", train: str = "", extra: str = "", steps: int = 2) -> Path:
    cfg = d / f"{name}.toml"
    cfg.write_text(f"""
[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "tok"
[model.config]
vocab_size = 300
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
max_position_embeddings = 64
pad_token_id = 0
eos_token_id = 2
[data]
train = "prompts.jsonl"
max_length = 32
[train]
out_dir = "{d / name}"
steps = {steps}
batch_size = 2
lr = 5e-2
weight_decay = 0.0
schedule = "constant"
progress = false
{train}
[grpo]
rewards = ["myrewards:share_low"]
num_generations = 4
max_new_tokens = 6
{grpo}
{extra}
""")
    return cfg


def _fit(cfg: Path, overrides: list = ()) -> list[dict]:
    build_trainer(load_run_config(cfg, overrides)).fit()
    return [r for r in read_metrics(cfg.parent / cfg.stem / "metrics.jsonl") if "reward" in r]


def test_mean_reward_rises_on_a_learnable_task(grpo_dir):
    """The reward is the share of completion tokens from the lower third of the vocabulary: a policy gradient
    moves probability there everywhere, which even a random tiny model does in a few steps."""
    rows = _fit(_toml(grpo_dir, "learn", steps=16, grpo='loss_type = "grpo"'))
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # a step's mean reward is over 48 tokens: at p ~ 1/3 its sampling std is ~0.07, ~0.04 for a mean of three
    # steps; a rise of 0.2 is five of those
    assert last > first + 0.2, rewards
    assert all(1 <= r["completion_length"] <= 6 for r in rows)  # EOS (id 2) ends some once the policy favours it
    assert {"reward/share_low", "reward_std", "clip_ratio", "logprob_gap"} <= set(rows[0])


def test_logprob_gap_is_zero_at_every_step_on_engine_rollouts_and_not_through_the_training_forward(grpo_dir):
    """At temperature 0.7, top_k 50, num_iterations 2: the engine's log_softmax(logits / T) of the sampled tokens
    against the trainer's, through the engine's kernels (kiln.engine.score, exact_logprobs = true): exactly 0 at
    every rollout. Controls that can fail: the same rollouts scored by the training forward (the default) differ
    from the sampler by fp32 rounding; sampler = "exact" (the trainer's forward as the sampler's log-probs) is 0
    by construction. (kiln's earlier loop, a control here before, was removed: engfsdp.)"""
    grpo = 'temperature = 0.7\ntop_k = 50\nnum_iterations = 2\n'
    engine = _fit(_toml(grpo_dir, "gap-engine", grpo=grpo + "exact_logprobs = true", steps=6))
    assert [r["logprob_gap"] for r in engine if "logprob_gap" in r] == [0.0, 0.0, 0.0]
    training = _fit(_toml(grpo_dir, "gap-training", grpo=grpo, steps=2))  # the default
    exact = _fit(_toml(grpo_dir, "gap-exact", grpo='sampler = "exact"\ntemperature = 0.7'))
    assert [r["logprob_gap"] for r in exact] == [0.0, 0.0]
    # a 2-layer fp32 model: its log-probs through two summation orders differ by ~1e-7 per op, well under 1e-5
    gaps = [r["logprob_gap"] for r in training if "logprob_gap" in r]
    assert all(g <= 1e-5 for g in gaps) and any(g > 0 for g in gaps), gaps


def test_the_same_seed_gives_the_same_run_on_the_engine(grpo_dir):
    """What changed with the engine: completion j of a prompt draws from its own generator (seeded from the
    micro-batch's generator, itself seeded by the run's seed and the rollout's place), where kiln's earlier loop
    drew every row of a micro-batch from one generator. So a seed gives other completions than before the engine,
    and the same run every time (metrics and weights bit for bit). A control: another seed gives other completions."""
    def run(name: str, seed: int) -> tuple[list, dict]:
        rows = _fit(_toml(grpo_dir, name, grpo="temperature = 0.9\ntop_p = 0.9", steps=3), [("train.seed", seed)])
        weights = load_file(str(grpo_dir / name / "ckpt-000003" / "model" / "model.safetensors"))
        return [sorted((k, v) for k, v in r.items() if not k.endswith("_per_s")) for r in rows], weights

    (a, wa), (b, wb), (c, _) = run("seed-a", 4), run("seed-b", 4), run("seed-c", 5)
    assert a == b and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a != c


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_kl_to_the_reference_starts_at_zero_then_grows(grpo_dir, lora):
    """At step 1 the policy is the reference (a frozen copy; under [lora] B = 0, the base with adapters off gives
    the same numbers): KL exactly 0. After one update it is positive."""
    name = "kl-lora" if lora else "kl-copy"
    extra = '[lora]\nr = 4\nalpha = 8\ntargets = "all-linear"' if lora else ""
    rows = _fit(_toml(grpo_dir, name, grpo="beta = 0.1", extra=extra), [("train.lr", 0.1)] if lora else [])
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0, rows


def test_num_generations_of_one_is_refused(grpo_dir):
    with pytest.raises(ConfigError, match="grpo.num_generations must be >= 2"):
        load_run_config(_toml(grpo_dir, "one"), overrides=[("grpo.num_generations", 1)])


def test_unknown_reward_module_and_function_are_named(grpo_dir):
    cfg = load_run_config(_toml(grpo_dir, "bad-mod"), overrides=[("grpo.rewards", ["nosuchmod:f"])])
    with pytest.raises(ConfigError, match="no module 'nosuchmod'"):
        build_trainer(cfg)
    cfg = load_run_config(_toml(grpo_dir, "bad-fn"), overrides=[("grpo.rewards", ["myrewards:nope"])])
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        build_trainer(cfg)
    cfg = load_run_config(_toml(grpo_dir, "bad-builtin"), overrides=[("grpo.rewards", ["exactmatch"])])
    with pytest.raises(ConfigError, match="'exactmatch' is neither"):
        build_trainer(cfg)


def test_a_reward_column_missing_or_mixed_prompt_kinds_are_refused_before_the_model(grpo_dir, monkeypatch):
    """A reward function's required column (a parameter without a default) must be in every row, and a file's
    prompts all plain text or all message lists: both refused naming the row, before the model is built."""
    import kiln.train.recipes.grpo as recipe

    def no_model(*_, **__):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(recipe, "build_model", no_model)
    cfg = load_run_config(_toml(grpo_dir, "no-level"), overrides=[("grpo.rewards", ["myrewards:by_level"])])
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: the reward function 'by_level' takes a 'level' column, "
                                          r"and this row of data.train .* has none \(its columns: answer, prompt\)"):
        build_trainer(cfg)
    cfg = load_run_config(_toml(grpo_dir, "no-answer"), overrides=[("grpo.rewards", ["exact_match"])])
    with pytest.raises(AssertionError, match="the model was built"):  # control: 'answer' is in every row
        build_trainer(cfg)
    mixed = [{"prompt": "plain"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    (grpo_dir / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    cfg = load_run_config(_toml(grpo_dir, "mixed"), overrides=[("data.train", str(grpo_dir / "mixed.jsonl"))])
    with pytest.raises(KilnError, match=r"mixes plain-text prompts \(first at .*mixed.jsonl:1\) and conversational "
                                        r"message lists \(first at .*mixed.jsonl:2\)"):
        build_trainer(cfg)


@pytest.mark.parametrize("fn, message", [
    ("boom", r"reward function 'boom' \(myrewards:boom\) raised RuntimeError: no score for you \(on a batch whose "
             r"first prompt is .*prompts.jsonl:\d+\)"),
    ("short", r"reward function 'short' returned 7 rewards for 8 completions"),
    ("nan_on_second", r"reward function 'nan_on_second' returned nan for completion 1 of .*prompts.jsonl:\d+"),
])
def test_a_bad_reward_function_is_named_with_the_row(grpo_dir, fn, message):
    cfg = load_run_config(_toml(grpo_dir, f"bad-{fn}", steps=1), overrides=[("grpo.rewards", [f"myrewards:{fn}"]),
                                                                         ("grpo.reward_max_failures", 1)])
    with pytest.raises(KilnError, match=message):
        build_trainer(cfg).fit()


@pytest.mark.slow
def test_sigkill_mid_rollout_then_resume_is_exact(grpo_dir):
    """num_iterations = 2: killed after step 4, the newest checkpoint is step 3, in the middle of the rollout of
    steps 3-4; the resumed run must take step 4 on the saved rollout and then draw step 5's as the reference did."""
    grpo, train = "num_iterations = 2\nbeta = 0.05", "save_every = 1\nkeep_last = 10"
    ref = _toml(grpo_dir, "ref", grpo=grpo, train=train, steps=6)
    kiln("train", "--config", str(ref))
    cfg = _toml(grpo_dir, "killed", grpo=grpo, train=train, steps=6)
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:4"}, check=False)
    assert p.returncode == -9, p.stderr
    assert (grpo_dir / "killed" / "ckpt-000003").is_dir() and not (grpo_dir / "killed" / "ckpt-000004").exists()
    kiln("train", "--config", str(cfg), "--resume", str(grpo_dir / "killed"))
    for step in (4, 5, 6):
        a = load_file(str(grpo_dir / "ref" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(grpo_dir / "killed" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"

    def curve(run: Path) -> list:
        return [sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))
                for r in read_metrics(run / "metrics.jsonl")]
    assert curve(grpo_dir / "killed") == curve(grpo_dir / "ref")
    assert any(r.get("reward", 0) > 0 for r in read_metrics(grpo_dir / "ref" / "metrics.jsonl"))


@pytest.mark.slow
def test_ddp_two_processes_kill_and_resume_mid_rollout_is_exact(grpo_dir):
    """`kiln launch` with 2 gloo processes: each rank samples its own prompts' groups; killed after step 2 (mid
    rollout, newest checkpoint 1), the resumed run restores every rank's own rollout and ends where an
    uninterrupted 2-process run ends."""
    grpo, train = "num_iterations = 2", "save_every = 1\nkeep_last = 10"
    ref = _toml(grpo_dir, "ddp-ref", grpo=grpo, train=train, steps=4)
    launch = ("launch", "--nproc-per-node", "2", "--", "train", "--config")
    kiln(*launch, str(ref))
    cfg = _toml(grpo_dir, "ddp-killed", grpo=grpo, train=train, steps=4)
    p = kiln(*launch, str(cfg), env={"KILN_FAULT": "step:2"}, check=False)
    assert p.returncode != 0
    assert (grpo_dir / "ddp-killed" / "ckpt-000001").is_dir() and not (grpo_dir / "ddp-killed" / "ckpt-000002").exists()
    kiln(*launch, str(cfg), "--resume", str(grpo_dir / "ddp-killed"))
    for step in (2, 4):
        a = load_file(str(grpo_dir / "ddp-ref" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(grpo_dir / "ddp-killed" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"
    def curve(run: Path) -> list:
        return [sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))
                for r in read_metrics(run / "metrics.jsonl")]
    assert curve(grpo_dir / "ddp-killed") == curve(grpo_dir / "ddp-ref")


@pytest.mark.slow
def test_ddp_two_processes_roll_out_on_their_own_engines_and_equal_one_process(grpo_dir):
    """`kiln launch` with 2 gloo processes, DDP: each rank rolls out its own prompts on its own engine (request
    seeds from the micro-batch's place in the global batch), scores through the engine's kernels (DDP's forward
    bypassed: the gradients averaged by hand) and ends where one process with grad_accum 2 ends, logprob_gap 0
    at every step on both."""
    grpo = "temperature = 0.8\nbeta = 0.05\nexact_logprobs = true"
    one = _toml(grpo_dir, "ddp-one", grpo=grpo, train="grad_accum = 2", steps=3)
    _fit(one)
    two = _toml(grpo_dir, "ddp-two", grpo=grpo, steps=3)
    p = kiln("launch", "--nproc-per-node", "2", "--", "train", "--config", str(two))
    assert "generate loop" not in p.stdout
    a, b = (read_metrics(grpo_dir / name / "metrics.jsonl") for name in ("ddp-one", "ddp-two"))
    a, b = [r for r in a if "loss" in r], [r for r in b if "loss" in r]
    assert len(a) == len(b) == 3
    assert [r["logprob_gap"] for r in a] == [r["logprob_gap"] for r in b] == [0.0, 0.0, 0.0]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]  # the same completions drawn
    for k in ("loss", "kl", "completion_length"):
        # fp32 sums in another order (two ranks' halves): ~1e-7 relative per step, grown by AdamW over 3 steps
        torch.testing.assert_close(torch.tensor([r[k] for r in b]), torch.tensor([r[k] for r in a]), rtol=1e-5,
                                   atol=1e-6, msg=k)
    wa = load_file(str(grpo_dir / "ddp-one" / "ckpt-000003" / "model" / "model.safetensors"))
    wb = load_file(str(grpo_dir / "ddp-two" / "ckpt-000003" / "model" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("grpo, message", [
    ('importance_sampling_correction = true', r'grpo.importance_sampling_correction .* set grpo.sampler = "exact"'),
    ('importance_sampling_clip_min = 2.0\nimportance_sampling_clip_max = 1.0',
     r"grpo.importance_sampling_clip_min \(2.0\) must be below grpo.importance_sampling_clip_max \(1.0\)"),
    ('sampler = "exact"\nimportance_sampling_correction = true\nloss_type = "vespo"',
     r'grpo.loss_type = "vespo" takes a token-level correction'),
    ('normalize_advantages = true', r"grpo.normalize_advantages is RLOO's option"),
    ('delta = 0.9', r"grpo.delta caps the importance weight and must be > 1"),
    ('off_policy_mask_threshold = 0.0', r"grpo.off_policy_mask_threshold must be > 0"),
    ('loss_type = "ppo"', r"loss_type"),
    ('importance_sampling_level = "episode"', r"importance_sampling_level"),
])
def test_loss_options_are_checked_by_name(grpo_dir, grpo, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(_toml(grpo_dir, "opts", grpo=grpo))


@pytest.mark.parametrize("grpo", [
    'loss_type = "cispo"\nepsilon_high = 5.0\nadvantage_estimator = "rloo"\nnormalize_advantages = true',
    'loss_type = "grpo"\nimportance_sampling_level = "sequence"\nsampler = "exact"\nbeta = 0.05\n'
    'importance_sampling_correction = true\nmask_truncated_completions = true\nuse_bias_correction_kl = true',
    'loss_type = "vespo"\noff_policy_mask_threshold = 0.5\nsampler = "exact"\nimportance_sampling_correction = true\n'
    'importance_sampling_mode = "token_mask"',
], ids=["cispo-rloo", "gspo-is-masked", "vespo-opsm"])
def test_the_loss_family_runs_end_to_end(grpo_dir, grpo, request):
    """Two steps of each combination train on finite numbers (each formula's equality with TRL's is
    tests/train/test_grpo_loss.py's)."""
    rows = _fit(_toml(grpo_dir, f"family-{request.node.callspec.id}", grpo=grpo))
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows), rows
