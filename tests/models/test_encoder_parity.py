"""Encoder behaviour beyond the both-ways parity (tests/models/test_parity.py): a head loaded from another head's
checkpoint, problem types, a seeded new head."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.models import load_pretrained


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


@pytest.mark.parametrize("model_type,source,task,dropped,fresh", [
    ("roberta", "masked-lm", "sequence-classification", "lm_head.dense.weight", "classifier.dense.weight"),
    ("roberta", "sequence-classification", "masked-lm", "classifier.dense.weight", "lm_head.dense.weight"),
    ("xlm-roberta", "masked-lm", "sequence-classification", "lm_head.dense.weight", "classifier.dense.weight"),
    ("distilbert", "masked-lm", "sequence-classification", "vocab_transform.weight", "pre_classifier.weight")])
def test_a_head_that_shares_kiln_names_with_the_source_head_is_initialised_as_transformers_does(
        tiny_factory, model_type, source, task, dropped, fresh):
    """Two heads that share kiln names for different HF tensors (RoBERTa's MLM `head.dense` is `lm_head.dense`, its
    classifier's `classifier.dense`; DistilBERT's `vocab_transform` and `pre_classifier`): the source head's tensors
    are dropped, the new head drawn fresh from the seed, and the logits equal transformers' from the same seed."""
    src = tiny_factory(model_type, source)
    labels = {"num_labels": 3} if task == "sequence-classification" else {}
    ours = load_pretrained(src, task=task, seed=7, **labels)
    assert dropped in ours.load_report.ignored and fresh in ours.load_report.initialized
    torch.manual_seed(7)
    hf = getattr(transformers, ours.family.tasks[task].architecture).from_pretrained(src, **labels).eval()
    batch = {"input_ids": torch.tensor([[0, 7, 9, 12, 2], [0, 10, 2, 1, 1]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, hf(**batch).logits)


@pytest.mark.parametrize("source,task,fresh,overrides", [
    ("masked-lm", "sequence-classification", "classifier.weight", {}),
    ("masked-lm", "token-classification", "classifier.weight", {}),
    ("masked-lm", "question-answering", "classifier.weight", {}),
    ("base", "masked-lm", "head.dense.weight", {}),
    ("base", "sequence-classification", "head.dense.weight", {"classifier_bias": True}),
    ("base", "masked-lm", "decoder.weight", {"tie_word_embeddings": False})])
def test_a_new_modernbert_head_is_drawn_as_transformers_draws_it(tiny_factory, source, task, fresh, overrides):
    """ModernBERT's own init of a head the checkpoint lacks (transformers' `_init_weights`: truncated normals, the
    transform's dense scaled by depth, the classifier by hidden_size^-0.5, children before their parent), not the
    generic normal(0, 0.02): the same seed gives the same logits as transformers'."""
    src = tiny_factory("modernbert", source, **overrides)
    labels = {"num_labels": 3} if task in ("sequence-classification", "token-classification") else {}
    ours = load_pretrained(src, task=task, seed=7, **labels)
    assert fresh in ours.load_report.initialized
    torch.manual_seed(7)
    hf = getattr(transformers, ours.family.tasks[task].architecture).from_pretrained(src, **labels).eval()
    batch = {"input_ids": torch.tensor([[2, 7, 9, 12, 3], [2, 10, 3, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    with torch.no_grad():
        a, b = ours(**batch), hf(**batch)
    for name in ("logits", "start_logits", "end_logits"):
        if getattr(b, name, None) is not None:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
