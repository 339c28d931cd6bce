"""DPO against TRL 1.16 on the same batch: tokenization, and each loss type's value and gradients
(policy and reference differ), plus a hand computation of each formula on fixed log-probs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kiln.data.preference import encode_preferences
from kiln.data.records import Record
from kiln.hub import Tokenizer
from kiln.models.auto import load_pretrained
from kiln.models.common.fast import set_fast
from kiln.train.preference import preference_losses
from kiln.train.recipes.dpo import DPORun, DPOSection
from tests.train.dpo_helpers import arithmetic_pairs, hf_model_dir, make_tokenizer, standard_pairs

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_trl")
    rows = arithmetic_pairs(6)
    tok = make_tokenizer(d, rows + arithmetic_pairs(6, 1))
    return d, rows, tok, hf_model_dir(d / "policy", tok, 0), hf_model_dir(d / "reference", tok, 1)


def _trl_trainer(d, policy, ref, rows, loss_type="sigmoid"):
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(d / "trl"), per_device_train_batch_size=len(rows), max_length=40, report_to=[],
                     beta=0.3, loss_type=[loss_type], use_cpu=True, logging_steps=1, bf16=False)
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    return DPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(policy),
                      ref_model=transformers.AutoModelForCausalLM.from_pretrained(ref) if ref else None,
                      args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def _kiln_batch(rows, model_dir):
    from kiln.data.loader import pad_collate

    examples, _ = encode_preferences([Record(r, f"rows:{i + 1}") for i, r in enumerate(rows)],
                                     Tokenizer.from_dir(model_dir), 40)
    return examples, pad_collate(examples)


@pytest.mark.parametrize("kind", ["conversational", "standard"])
def test_tokenized_as_trl(setup, kind):
    d, _, _, policy, _ = setup
    rows = arithmetic_pairs(5, 3) if kind == "conversational" else standard_pairs(5)
    tr = _trl_trainer(d, policy, None, rows)
    examples, _ = _kiln_batch(rows, policy)
    for ex, ref in zip(examples, tr.train_dataset):
        for name in ("chosen", "rejected"):
            want = ref["prompt_ids"] + ref[f"{name}_ids"]
            assert ex[f"{name}_ids"].tolist() == want
            assert ex[f"{name}_mask"].tolist() == [0] * len(ref["prompt_ids"]) + [1] * len(ref[f"{name}_ids"])


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_losses_and_gradients_equal_trl(setup, loss_type):
    d, rows, _, policy, ref = setup
    tr = _trl_trainer(d, policy, ref, rows, loss_type)
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(rows))])
    want = tr.compute_loss(tr.model, batch)
    want.backward()
    want_grads = _grads(tr.model)

    run = DPORun(DPOSection(loss_type=loss_type, beta=0.3), [], None, None)
    run.ref_model = set_fast(load_pretrained(ref, task="causal-lm")).eval()
    model = set_fast(load_pretrained(policy, task="causal-lm"))  # the chunked path training runs
    _, kbatch = _kiln_batch(rows, policy)
    pl, _ = run.pair_losses(model, kbatch, "train")
    got = pl.losses.mean()
    got.backward()
    assert abs(got.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))  # fp32 sums of ~40 log-probs
    assert float(pl.chosen_rewards.abs().max()) > 1e-3  # policy != reference: the rewards are not all zero
    grads = _grads(model)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-4, msg=name)


def _hf_logps(model, batch, average):
    """TRL's CPO/ORPO `get_batch_logps` on the HF model's logits: labels are the completion tokens."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return out.logits, CPOTrainer.get_batch_logps(out.logits, labels, average_log_prob=average)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_and_gradients_equal_trl(setup, loss_type):
    import transformers
    from torch.nn import functional as F
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    d, rows, _, policy, _ = setup
    tr = _trl_trainer(d, policy, None, rows)  # its collator: the same DPO-tokenized batch for both
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(rows))])
    hf = transformers.AutoModelForCausalLM.from_pretrained(policy)
    logits, logps = _hf_logps(hf, batch, average=True)
    n = len(rows)
    device = SimpleNamespace(device=torch.device("cpu"))
    if loss_type == "simpo":
        me = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1,
                             accelerator=device)
        want = CPOTrainer.cpo_loss(me, logps[:n], logps[n:])[0].mean()
        section = DPOSection(loss_type="simpo", beta=2.0, gamma=0.7, label_smoothing=0.1)
    else:  # ORPOTrainer.concatenated_forward's NLL: the whole chosen sequence, prompt included
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:n, 1:]
        nll = F.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        me = SimpleNamespace(beta=0.25, accelerator=device)
        want = nll - ORPOTrainer.odds_ratio_loss(me, logps[:n], logps[n:])[0].mean()
        section = DPOSection(loss_type="orpo", **{"lambda": 0.25})
    want.backward()
    want_grads = _grads(hf)

    run = DPORun(section, [], None, None)
    model = set_fast(load_pretrained(policy, task="causal-lm"))
    _, kbatch = _kiln_batch(rows, policy)
    pl, _ = run.pair_losses(model, kbatch, "train")
    got = pl.losses.mean()
    got.backward()
    assert abs(got.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))  # fp32 sums of ~40 log-probs
    grads = _grads(model)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-4, msg=name)


def test_each_formula_by_hand():
    """Fixed log-probs through each formula, written out with math (no torch function shared)."""
    c, r, rc, rr, nc, nr = -12.0, -15.0, -13.0, -14.0, 4.0, 6.0
    t = lambda x: torch.tensor([x])  # noqa: E731
    beta, ls = 0.5, 0.1

    def logsig(x):
        return -math.log1p(math.exp(-x))

    def run(kind, **kw):
        out = preference_losses(kind, t(c), t(r), t(nc), t(nr), ref_chosen=t(rc), ref_rejected=t(rr), beta=beta, **kw)
        return float(out.losses[0]), float(out.chosen_rewards[0]), float(out.rejected_rewards[0])

    delta = (c - rc) - (r - rr)  # 1 - (-1) = 2
    assert run("sigmoid") == pytest.approx((-logsig(beta * delta), beta * (c - rc), beta * (r - rr)), rel=1e-6)
    smooth = -(1 - ls) * logsig(beta * delta) - ls * logsig(-beta * delta)
    assert run("sigmoid", label_smoothing=ls)[0] == pytest.approx(smooth, rel=1e-6)
    assert run("hinge")[0] == pytest.approx(max(0.0, 1 - beta * delta), rel=1e-6, abs=1e-7)
    ipo = ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2
    assert run("ipo")[0] == pytest.approx(ipo, rel=1e-6)
    z = (c / nc - r / nr) - 0.3 / beta
    simpo = -(1 - ls) * logsig(beta * z) - ls * logsig(-beta * z)
    assert run("simpo", gamma=0.3, label_smoothing=ls) == pytest.approx((simpo, beta * c / nc, beta * r / nr), rel=1e-6)
    ac, ar = c / nc, r / nr
    odds = (ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))
    got = preference_losses("orpo", t(c), t(r), t(nc), t(nr), lam=0.2, chosen_nll=torch.tensor(2.5))
    assert float(got.losses[0]) == pytest.approx(2.5 - 0.2 * logsig(odds), rel=1e-6)
    # control: the formulas disagree with each other, so a swapped branch would fail above
    assert len({round(run(k)[0], 6) for k in ("sigmoid", "hinge", "ipo")}) == 3
