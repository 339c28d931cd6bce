"""BERT, RoBERTa, XLM-R, DistilBERT x five heads: HF -> kiln and kiln -> HF, bit for bit (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.interop.verify import HF_AUTO
from kiln.models import load_pretrained

FAMILIES = ["bert", "roberta", "xlm-roberta", "distilbert"]
HEADS = ["base", "sequence-classification", "token-classification", "question-answering", "masked-lm"]


def _inputs(model_type: str, vocab: int, pad: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (4, 13), generator=g)
    attn = torch.ones_like(ids)
    for row, n in ((1, 9), (2, 4), (3, 1)):  # right padding of different lengths
        attn[row, n:] = 0
        ids[row, n:] = pad
    batches = [{"input_ids": ids[:1, :7]}, {"input_ids": ids, "attention_mask": attn}]
    if model_type == "bert":
        types = torch.zeros_like(ids)
        types[:, 6:] = 1
        batches.append({"input_ids": ids, "attention_mask": attn, "token_type_ids": types * attn})
    return batches


def _with_labels(task: str, batch: dict, num_labels: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(2)
    B, T = batch["input_ids"].shape
    out = dict(batch)
    if task == "sequence-classification":
        out["labels"] = torch.randint(0, num_labels, (B,), generator=g)
    elif task in ("token-classification", "masked-lm"):
        labels = torch.randint(0, num_labels if task == "token-classification" else vocab, (B, T), generator=g)
        labels[batch.get("attention_mask", torch.ones_like(labels)) == 0] = -100
        out["labels"] = labels
    elif task == "question-answering":
        out["start_positions"] = torch.randint(0, T, (B,), generator=g)
        out["end_positions"] = torch.randint(0, T + 4, (B,), generator=g)  # past the end: clamped and ignored
    return out


def _assert_same(ours, theirs, names=("last_hidden_state", "pooler_output", "logits", "start_logits",
                                      "end_logits", "loss")) -> int:
    compared = 0
    for name in names:
        b = getattr(theirs, name, None)
        if b is None:
            continue
        a = getattr(ours, name)
        assert a is not None, f"kiln returned no {name}"
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # rtol = atol = 0: bit-identical (a loss over only ignored positions is NaN on both sides)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        compared += 1
    return compared


@pytest.mark.parametrize("task", HEADS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_bit_exact(model_type, task, tiny_factory, tmp_path):
    src = tiny_factory(model_type, task)
    auto = getattr(transformers, HF_AUTO[task])
    hf = auto.from_pretrained(src).eval()
    ours = load_pretrained(src)
    assert ours.task == task and ours.family.model_type == model_type
    vocab = hf.config.vocab_size
    num_labels = getattr(hf.config, "num_labels", 2)
    pad = hf.config.pad_token_id

    def run_all(kiln_model, hf_model):
        for batch in _inputs(model_type, vocab, pad):
            for b in (batch, _with_labels(task, batch, num_labels, vocab)):
                with torch.no_grad():
                    n = _assert_same(kiln_model(**b), hf_model(**b))
                assert n >= 1
                if len(b) > len(batch) and task != "base":
                    with torch.no_grad():
                        assert kiln_model(**b).loss is not None

    run_all(ours, hf)  # HF -> kiln

    out = tmp_path / "export"
    ours.save_pretrained(out)
    back, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back).__name__ == type(hf).__name__
    run_all(ours, back.eval())  # kiln -> HF


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
