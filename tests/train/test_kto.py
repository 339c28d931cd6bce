"""[kto] against TRL 1.16's KTOTrainer on the same batch (tokenization, loss and gradients with the KL reference
point), a row without a label refused before work starts, and the desirable margin growing over a short run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.data.kto import encode_unpaired
from kiln.data.loader import pad_collate
from kiln.data.records import Record
from kiln.errors import ConfigError, KilnError
from kiln.hub import Tokenizer
from kiln.models.auto import load_pretrained
from kiln.models.common.fast import set_fast
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.recipes.kto import KTORun, KTOSection
from kiln.train.run import build_trainer
from tests.train.dpo_helpers import (
    arithmetic_pairs,
    hf_model_dir,
    make_tokenizer,
    model_section,
    standard_pairs,
    write_jsonl,
)


def unpaired(pairs: list[dict], pattern: str = "ggb") -> list[dict]:
    """One row per pair: its chosen reply as desirable ('g') or its rejected one as undesirable ('b'), by pattern."""
    rows = []
    for i, r in enumerate(pairs):
        good = pattern[i % len(pattern)] == "g"
        rows.append({"prompt": r["prompt"], "completion": r["chosen" if good else "rejected"], "label": good})
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kto_trl")
    tok = make_tokenizer(d, arithmetic_pairs(12) + arithmetic_pairs(6, 1))
    return d, hf_model_dir(d / "policy", tok, 0), hf_model_dir(d / "reference", tok, 1)


def _trl(d, policy, ref, rows, **kw):
    import transformers
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(d / "trl"), per_device_train_batch_size=len(rows), max_length=40, report_to=[],
                     use_cpu=True, bf16=False, **kw)
    return KTOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(policy),
                      ref_model=transformers.AutoModelForCausalLM.from_pretrained(ref) if ref else None, args=args,
                      train_dataset=Dataset.from_list(rows),
                      processing_class=transformers.AutoTokenizer.from_pretrained(policy))


def _kiln(rows, model_dir):
    examples, stats = encode_unpaired([Record(r, f"rows:{i + 1}") for i, r in enumerate(rows)],
                                      Tokenizer.from_dir(model_dir), 40)
    return examples, pad_collate(examples), stats


@pytest.mark.parametrize("kind", ["conversational", "standard"])
def test_tokenized_as_trl(setup, kind):
    d, policy, _ = setup
    rows = unpaired(arithmetic_pairs(5, 3) if kind == "conversational" else standard_pairs(5))
    tr = _trl(d, policy, None, rows)
    examples, _, stats = _kiln(rows, policy)
    assert stats.rows == len(tr.train_dataset) == 5 and stats.desirable == 4
    for ex, ref in zip(examples, tr.train_dataset):
        assert ex["prompt_ids"].tolist() == ref["prompt_ids"]
        assert ex["completion_ids"].tolist() == ref["completion_ids"]
        assert bool(ex["label"]) == ref["label"]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_loss_and_gradients_equal_trl(setup, loss_type):
    d, policy, ref = setup
    if loss_type == "kto":  # these two models this way round give a positive KL estimate (the other way it clamps to 0)
        policy, ref = ref, policy
    rows = unpaired(arithmetic_pairs(6))
    kw = dict(beta=0.3, desirable_weight=1.0, undesirable_weight=1.7, loss_type=loss_type)
    tr = _trl(d, policy, ref, rows, **kw)
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(rows))])
    assert ("KL_input_ids" in batch) == (loss_type == "kto")
    want = tr.compute_loss(tr.model, batch)
    want.backward()
    want_grads = _grads(tr.model)
    want_kl = tr._metrics["train" if tr.model.training else "eval"]["kl"][-1]

    run = KTORun(KTOSection(**kw), 40, None, None)
    run.ref_model = set_fast(load_pretrained(ref, task="causal-lm")).eval()
    model = set_fast(load_pretrained(policy, task="causal-lm"))  # the chunked path training runs
    _, kbatch, _ = _kiln(rows, policy)
    losses, info = run.row_losses(model, kbatch)
    got = losses.mean()
    got.backward()
    # fp32 sums of ~20 log-probs through a sigmoid: far inside 1e-5 relative
    assert abs(got.item() - want.item()) < 1e-5 * max(1.0, abs(want.item())), (got.item(), want.item())
    assert abs(float(info["kl"]) - want_kl) < 1e-4 * max(1.0, abs(want_kl)), (float(info["kl"]), want_kl)
    if loss_type == "kto":
        assert float(info["kl"]) > 0  # control: policy != reference, the reference point is not the clamp's 0
    assert float(info["rewards"].abs().max()) > 1e-3
    grads = _grads(model)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-4, msg=name)


def run_toml(d: Path, out: str, kto: str = "", steps: int = 12, **data) -> Path:
    body = f"""
{model_section(d)}[data]
train = "{data.get('train', d / 'train.jsonl')}"
eval = "{d / 'eval.jsonl'}"
max_length = 40
[train]
out_dir = "{d / out}"
seed = 1
steps = {steps}
batch_size = {data.get('batch_size', 8)}
lr = 5e-3
weight_decay = 0.0
progress = false
log_every = 1
eval_every = 6
save_every = 6
[kto]
beta = 0.2
{kto}
"""
    path = d / f"{out}.toml"
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kto")
    pairs = arithmetic_pairs(96)
    write_jsonl(d / "train.jsonl", unpaired(pairs[:80], "gb"))
    write_jsonl(d / "eval.jsonl", unpaired(pairs[80:], "gb"))
    make_tokenizer(d, pairs)
    return d


def test_a_row_without_a_label_is_refused_before_work(rows_dir, tmp_path):
    rows = unpaired(arithmetic_pairs(3)) + [{"prompt": [{"role": "user", "content": "hi"}],
                                              "completion": [{"role": "assistant", "content": "yo"}]}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(KilnError, match=r"bad\.jsonl:4: a KTO row needs 'prompt', 'completion' and 'label' .*"
                                        r"missing 'label'"):
        build_trainer(load_run_config(run_toml(rows_dir, "bad", train=bad)))
    assert not (rows_dir / "bad").exists()
    paired = write_jsonl(tmp_path / "paired.jsonl", arithmetic_pairs(2))
    with pytest.raises(KilnError, match="a paired row"):
        build_trainer(load_run_config(run_toml(rows_dir, "bad", train=paired)))
    with pytest.raises(ConfigError, match="train.batch_size must be at least 2"):
        build_trainer(load_run_config(run_toml(rows_dir, "bad", batch_size=1)))
    with pytest.raises(ConfigError, match="kto.undesirable_weight must be a finite number > 0, got 0"):
        load_run_config(run_toml(rows_dir, "bad", kto="undesirable_weight = 0"))
    with pytest.raises(ConfigError, match="kto.desirable_weight must be a finite number > 0, got inf"):
        load_run_config(run_toml(rows_dir, "bad", kto="desirable_weight = inf"))


def test_desirable_margin_grows(rows_dir):
    """A tiny Qwen3 from scratch on arithmetic rows (right sums desirable, wrong ones undesirable): the margin between
    desirable and undesirable rewards is 0 at the first step (policy = reference) and grows on held-out rows."""
    build_trainer(load_run_config(run_toml(rows_dir, "run"))).fit()
    records = read_metrics(rows_dir / "run" / "metrics.jsonl")
    assert records[0]["rewards/margins"] == 0.0 and records[0]["kl"] == 0.0  # nothing has moved yet
    evals = [r for r in records if "eval_rewards/margins" in r]
    assert len(evals) == 2, evals
    first, last = evals[0]["eval_rewards/margins"], evals[-1]["eval_rewards/margins"]
    assert last > first > 0, (first, last)


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(rows_dir):
    from safetensors.torch import load_file

    from tests.train.train_helpers import kiln

    kiln("train", "--config", str(run_toml(rows_dir, "ref")))
    cfg = run_toml(rows_dir, "killed")
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:9"}, check=False)
    assert p.returncode == -9, p.stderr
    p = kiln("train", "--config", str(cfg), "--resume", str(rows_dir / "killed"))
    assert "from ckpt-000006" in p.stdout
    a = load_file(str(rows_dir / "ref" / "ckpt-000012" / "model" / "model.safetensors"))
    b = load_file(str(rows_dir / "killed" / "ckpt-000012" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def curve(run):
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in read_metrics(run / "metrics.jsonl")]

    assert curve(rows_dir / "killed") == curve(rows_dir / "ref")
