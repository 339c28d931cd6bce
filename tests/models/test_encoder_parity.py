"""BERT, RoBERTa, XLM-R, DistilBERT x five heads: HF -> kiln and kiln -> HF, bit for bit (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.models.tasks import get_task
from kiln.models import load_pretrained

from tests.models.encoder_cases import HEADS, run_both

FAMILIES = ["bert", "roberta", "xlm-roberta", "distilbert"]


@pytest.mark.parametrize("task", HEADS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_bit_exact(model_type, task, tiny_factory, tmp_path):
    src = tiny_factory(model_type, task)
    auto = getattr(transformers, get_task(task).hf_auto)
    hf = auto.from_pretrained(src).eval()
    ours = load_pretrained(src)
    assert ours.task == task and ours.family.model_type == model_type
    token_types = model_type == "bert"  # the families with more than one token type in their tiny config

    run_both(ours, hf, task, token_types)  # HF -> kiln

    out = tmp_path / "export"
    ours.save_pretrained(out)
    back, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back).__name__ == type(hf).__name__
    run_both(ours, back.eval(), task, token_types)  # kiln -> HF


def test_backbone_loads_from_task_checkpoint_and_head_is_initialised(tiny_factory):
    """A masked-LM checkpoint loads as a classifier: backbone copied, head freshly initialised."""
    src = tiny_factory("bert", "masked-lm")
    clf = load_pretrained(src, task="sequence-classification", num_labels=4)
    mlm = load_pretrained(src)
    assert clf.config.num_labels == 4
    assert torch.equal(clf.model.layers[0].attn.q_proj.weight, mlm.model.layers[0].attn.q_proj.weight)
    assert any("classifier" in n for n in clf.load_report.initialized)
    assert any("cls.predictions" in n for n in clf.load_report.ignored)
    out = clf(input_ids=torch.tensor([[2, 7, 9, 3]]), labels=torch.tensor([1]))
    assert out.logits.shape == (1, 4) and torch.isfinite(out.loss)


def test_problem_types_match_transformers(tiny_factory):
    """Regression and multi-label losses equal HF's for the same logits."""
    for problem, num_labels, labels in (
        ("regression", 1, torch.tensor([0.5, -1.0])),
        ("multi_label_classification", 3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),
    ):
        src = tiny_factory("bert", "sequence-classification", num_labels=num_labels, problem_type=problem)
        ours = load_pretrained(src)
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(src).eval()
        batch = {"input_ids": torch.tensor([[2, 8, 9, 3], [2, 10, 3, 0]]),
                 "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), "labels": labels}
        with torch.no_grad():
            a, b = ours(**batch), hf(**batch)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss), problem


def test_a_new_head_is_initialised_reproducibly_from_a_seed(tiny_factory):
    """Two loads with the same seed give the same fresh classifier (a run's seed must cover its head)."""
    src = tiny_factory("bert", "masked-lm")
    a = load_pretrained(src, task="sequence-classification", num_labels=3, seed=7)
    torch.rand(5)  # move the global generator: the seed, not the state, decides
    b = load_pretrained(src, task="sequence-classification", num_labels=3, seed=7)
    c = load_pretrained(src, task="sequence-classification", num_labels=3, seed=8)
    assert torch.equal(a.head.classifier.weight, b.head.classifier.weight)
    assert not torch.equal(a.head.classifier.weight, c.head.classifier.weight)
