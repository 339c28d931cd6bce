"""The reward-model recipe: tokenization, first-step loss and gradients against TRL 1.16's RewardTrainer, a bad row
named before work starts, held-out accuracy rising on chatterbot pairs, the export scored equally by transformers,
and SIGKILL + resume exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.data.loader import pad_collate
from kiln.data.records import Record
from kiln.data.reward import encode_reward_pairs
from kiln.errors import ConfigError, KilnError
from kiln.hub import Tokenizer
from kiln.models.auto import load_pretrained
from kiln.parallel.world import launched_world
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.recipes.reward_model import RECIPE, RewardRun, RewardSection
from kiln.train.run import build_trainer
from tests.train.dpo_helpers import (
    QWEN3,
    arithmetic_pairs,
    chatterbot_pairs,
    make_tokenizer,
    standard_pairs,
    write_jsonl,
)
from tests.train.train_helpers import kiln


def hf_reward_dir(d: Path, tok: Path, seed: int) -> Path:
    """A transformers Qwen3ForSequenceClassification with one label, random weights (seed) and the tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**QWEN3, num_labels=1))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # rewards far enough apart that the loss has real gradients
    model.save_pretrained(d)
    transformers.AutoTokenizer.from_pretrained(tok).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("reward")
    rows = arithmetic_pairs(6)
    tok = make_tokenizer(d, rows + arithmetic_pairs(6, 1))
    return d, rows, hf_reward_dir(d / "rm", tok, 0)


def _trl(d, model_dir, rows, center=None):
    import transformers
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(d / "trl"), per_device_train_batch_size=len(rows), max_length=40,
                        report_to=[], use_cpu=True, bf16=False, center_rewards_coefficient=center)
    return RewardTrainer(model=transformers.AutoModelForSequenceClassification.from_pretrained(model_dir), args=args,
                         train_dataset=Dataset.from_list(rows),
                         processing_class=transformers.AutoTokenizer.from_pretrained(model_dir))


def _kiln(rows, model_dir):
    examples, stats = encode_reward_pairs([Record(r, f"rows:{i + 1}") for i, r in enumerate(rows)],
                                          Tokenizer.from_dir(model_dir), 40)
    return examples, pad_collate(examples), stats


@pytest.mark.parametrize("kind", ["conversational", "standard", "implicit"])
def test_tokenized_as_trl(setup, kind):
    d, _, model_dir = setup
    rows = {"conversational": arithmetic_pairs(5, 3), "standard": standard_pairs(5),
            "implicit": [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                         for r in standard_pairs(5)]}[kind]
    tr = _trl(d, model_dir, rows)
    examples, _, stats = _kiln(rows, model_dir)
    assert stats.pairs == len(tr.train_dataset) == 5
    for ex, ref in zip(examples, tr.train_dataset):
        assert ex["chosen_ids"].tolist() == ref["chosen_ids"] and ex["rejected_ids"].tolist() == ref["rejected_ids"]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("margin, center", [(False, None), (True, 0.05)])
def test_first_step_loss_and_gradients_equal_trl(setup, margin, center):
    d, rows, model_dir = setup
    if margin:
        rows = [{**r, "margin": 0.25 * i} for i, r in enumerate(rows)]
    tr = _trl(d, model_dir, rows, center)
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(rows))])
    assert ("margin" in batch) == margin
    want = tr.compute_loss(tr.model, batch)
    want.backward()
    want_grads = _grads(tr.model)

    model = load_pretrained(model_dir)
    assert model.task == "sequence-classification" and model.config.pad_token_id == 0
    run = RewardRun(RewardSection(center_rewards_coefficient=center), model.config.pad_token_id, None)
    _, kbatch, _ = _kiln(rows, model_dir)
    losses, chosen, rejected, _ = run.pair_losses(model, kbatch)
    got = losses.mean()
    got.backward()
    # fp32 rewards of O(1) through a logsigmoid: agreement far inside 1e-5 relative
    assert abs(got.item() - want.item()) < 1e-5 * max(1.0, abs(want.item())), (got.item(), want.item())
    assert float((chosen - rejected).abs().max()) > 1e-2  # control: the rewards differ, the loss is not log 2
    grads = _grads(model)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        scale = float(g.abs().max()) or 1.0
        assert float((grads[name] - g).abs().max()) <= 1e-5 * scale + 1e-7, name


def run_toml(d: Path, out: str, steps: int = 8, extra: str = "", rm: str = "", **data) -> Path:
    config = "\n".join(f"{k} = {v}" for k, v in QWEN3.items())
    body = f"""[model]
family = "qwen3"
task = "reward-model"
tokenizer = "{d / 'tok'}"
[model.config]
{config}
[data]
train = "{data.get('train', d / 'train.jsonl')}"
eval = "{data.get('eval', d / 'eval.jsonl')}"
max_length = {data.get('max_length', 40)}
[train]
out_dir = "{d / out}"
seed = 1
steps = {steps}
batch_size = {data.get('batch_size', 4)}
lr = {data.get('lr', '1e-2')}
weight_decay = 0.0
progress = false
log_every = 1
eval_every = {data.get('eval_every', 4)}
save_every = 4
keep_last = 5
{extra}
{rm}
"""
    path = d / f"{out}.toml"
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rm_run")
    rows = arithmetic_pairs(48)
    write_jsonl(d / "train.jsonl", rows[:40])
    write_jsonl(d / "eval.jsonl", rows[40:])
    make_tokenizer(d, rows)
    return d


def test_a_row_without_both_sides_is_refused_before_work(pairs, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", arithmetic_pairs(2) + [{"prompt": "hi", "chosen": "yes"}])
    with pytest.raises(KilnError, match=r"bad\.jsonl:3: a reward-model row needs both sides, 'chosen' and "
                                        r"'rejected'; missing 'rejected'"):
        build_trainer(load_run_config(run_toml(pairs, "bad", train=bad)))
    assert not (pairs / "bad").exists()  # refused before anything was written
    margin = write_jsonl(tmp_path / "margin.jsonl", [{**r, "margin": 1.0} for r in arithmetic_pairs(2)]
                         + arithmetic_pairs(1))
    with pytest.raises(KilnError, match=r"margin\.jsonl:3: 'margin' must be given on every row or on none"):
        build_trainer(load_run_config(run_toml(pairs, "bad", train=margin)))
    with pytest.raises(ConfigError, match="center_rewards_coefficient must be a finite number >= 0, got -1"):
        load_run_config(run_toml(pairs, "x", rm="[reward_model]\ncenter_rewards_coefficient = -1"))
    with pytest.raises(ConfigError, match="center_rewards_coefficient must be a finite number >= 0, got inf"):
        load_run_config(run_toml(pairs, "x", rm="[reward_model]\ncenter_rewards_coefficient = inf"))
    with pytest.raises(ConfigError, match="one output"):
        build_trainer(load_run_config(_rewrite(pairs, "x", "num_labels = 3")))
    with pytest.raises(ConfigError, match="trains full weights for now"):
        build_trainer(load_run_config(run_toml(pairs, "x", extra="[lora]\nr = 4")))


def _rewrite(d: Path, out: str, model_line: str) -> Path:
    path = run_toml(d, out)
    path.write_text(path.read_text().replace('task = "reward-model"', f'task = "reward-model"\n{model_line}'))
    return path


def test_export_scored_equally_by_transformers(pairs, tmp_path):
    """A short run's checkpoint exported by kiln: AutoModelForSequenceClassification gives kiln's rewards exactly."""
    import transformers

    kiln("train", "--config", str(run_toml(pairs, "short", steps=4)))
    out = tmp_path / "export"
    kiln("export", "--checkpoint", str(pairs / "short" / "ckpt-000004"), "--out", str(out))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    ours = load_pretrained(out).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == ours.config.pad_token_id
    _examples, batch, _ = _kiln(arithmetic_pairs(6, 9), out)
    from kiln.train.recipes.reward_model import pair_batch

    layout = pair_batch(batch, ours.config.pad_token_id)
    ids, attn = layout.input_ids, layout.attention_mask
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=attn).logits
        b = hf(input_ids=ids, attention_mask=attn).logits
    assert a.shape == b.shape == (12, 1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(a.std()) > 0  # control: the rewards are not one constant


def test_held_out_accuracy_rises_on_chatterbot_pairs(tmp_path):
    """A tiny Qwen3 reward model from scratch on chatterbot-corpus pairs (chosen: a dialog's real reply; rejected:
    another category's): held-out pair accuracy goes from chance to above 0.7 (0.50 -> 0.82 when written). On the
    ~310 held-out pairs within max_length the standard error near 0.8 is ~0.023, and an untrained model's accuracy
    is 0.5 +- 0.03."""
    pytest.importorskip("chatterbot_corpus")
    train, held = chatterbot_pairs()
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "eval.jsonl", held)
    from kiln.data.bpe import train_bpe

    text = write_jsonl(tmp_path / "text.jsonl", [{"messages": r["prompt"] + r["chosen"]} for r in train + held])
    train_bpe([text], tmp_path / "tok", vocab_size=512, min_frequency=1)
    path = run_toml(tmp_path, "run", steps=60, max_length=96, batch_size=16, lr="3e-3", eval_every=60)
    body = path.read_text()
    for k, v in {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}.items():
        body = body.replace(f"\n{k} = {QWEN3[k]}\n", f"\n{k} = {v}\n")
    path.write_text(body)
    cfg = load_run_config(path)
    parts = RECIPE.build(cfg, lambda m: None, launched_world())  # the run's starting model, seeded as the run's
    run = parts.callbacks[0]
    with torch.no_grad():
        _, chosen, rejected, _ = run.pair_losses(parts.model.eval(), pad_collate(parts.eval_data))
    before = float((chosen > rejected).double().mean())
    assert abs(before - 0.5) < 0.2, before  # chance before any update
    build_trainer(cfg).fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    final = [r for r in records if "eval_accuracy" in r][-1]
    print(f"held-out accuracy {before:.3f} -> {final['eval_accuracy']:.3f}")
    assert final["eval_accuracy"] > 0.7 and final["eval_accuracy"] > before + 0.15, (before, final)
    assert final["eval_margin"] > 0


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(pairs):
    kiln("train", "--config", str(run_toml(pairs, "ref", rm="[reward_model]\ncenter_rewards_coefficient = 0.01")))
    cfg = run_toml(pairs, "run", rm="[reward_model]\ncenter_rewards_coefficient = 0.01")
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:6"}, check=False)
    assert p.returncode == -9, p.stderr
    p = kiln("train", "--config", str(cfg), "--resume", str(pairs / "run"))
    assert "from ckpt-000004" in p.stdout
    for step in (4, 8):
        a = load_file(str(pairs / "ref" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(pairs / "run" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"

    def curve(run):
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in read_metrics(run / "metrics.jsonl")]

    assert curve(pairs / "run") == curve(pairs / "ref")
    assert len([r for r in read_metrics(pairs / "run" / "metrics.jsonl") if "loss" in r]) == 8


def test_load_reward_scores_as_the_model_and_plugs_into_grpo_scoring(pairs, tmp_path):
    """load_reward over a run directory (its newest checkpoint) scores GRPO's conversational completions as the
    exported model scores the same texts, batch size apart, through kiln.train.rewards.score."""
    import transformers

    from kiln.train.reward_model import load_reward
    from kiln.train.rewards import Reward, score

    run = pairs / "short"
    if not (run / "ckpt-000004").is_dir():
        kiln("train", "--config", str(run_toml(pairs, "short", steps=4)))
    fn = load_reward(run, device="cpu", batch_size=3)
    assert fn.source == run / "ckpt-000004" / "model" and fn.__name__ == "model_ckpt-000004"
    rows = arithmetic_pairs(5, 4)
    prompts = [r["prompt"] for r in rows] * 2
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    got = score([Reward(fn.__name__, fn, 1.0)], prompts, completions, [[0]] * 10, {}, [f"rows:{i}" for i in range(10)])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(fn.source).eval()
    tok = transformers.AutoTokenizer.from_pretrained(fn.source)
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([tok.apply_chat_template(p + c, tokenize=True, return_dict=True)["input_ids"]])
            want = float(hf(input_ids=ids).logits[0, 0])
            assert abs(float(got[i, 0]) - want) <= 1e-5 * max(1.0, abs(want)), (i, float(got[i, 0]), want)
    assert float(got.std()) > 0  # control: not one constant
    from kiln.train.rewards import resolve_rewards

    (named,) = resolve_rewards([f"model:{run}"], [0.5], [], format_pattern=None, max_new_tokens=8)
    assert named.name == fn.__name__ and named.weight == 0.5 and named.fn.source == fn.source  # `[grpo] rewards`
    with pytest.raises(KilnError, match="not a reward model"):
        from tests.train.dpo_helpers import hf_model_dir

        load_reward(hf_model_dir(tmp_path / "lm", pairs / "tok", 0))
    with pytest.raises(KilnError, match="no reward model here"):
        load_reward(tmp_path / "nowhere")
