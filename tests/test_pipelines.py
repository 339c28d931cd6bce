"""pipelines: fill_mask, classify, embed, generate on directories and on loaded models."""

from __future__ import annotations

import torch
import transformers
from typer.testing import CliRunner

from kiln import pipelines
from kiln.cli.main import app
from kiln.models import load_pretrained


def test_classify_scores_equal_transformers_softmax(tiny_factory):
    src = tiny_factory("roberta", "sequence-classification")
    out = pipelines.classify(src, ["paris is the capital of france", "a dog"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(src).eval()
    model = load_pretrained(src)
    batch = model.tokenizer.encode(["paris is the capital of france", "a dog"])
    with torch.no_grad():
        probs = hf(**batch).logits.softmax(-1)
    for row, p in zip(out, probs):
        assert len(row) == 3 and row[0]["score"] >= row[-1]["score"]
        for item in row:
            j = int(item["label"].split("_")[1])
            assert item["score"] == float(p[j])
    r = CliRunner().invoke(app, ["classify", str(src), "a dog", "--top", "2"], terminal_width=200)
    assert r.exit_code == 0 and r.output.count("LABEL_") == 2, r.output


def test_fill_mask_and_embed_accept_a_loaded_model(tiny_factory, minilm_dir):
    mlm = load_pretrained(tiny_factory("bert", "masked-lm"))
    top = pipelines.fill_mask(mlm, "paris is the [MASK] of france", k=4)
    assert len(top) == 4 and abs(sum(t["score"] for t in top) - 1) < 1  # probabilities, best first
    assert [t["score"] for t in top] == sorted((t["score"] for t in top), reverse=True)
    emb = pipelines.embed(minilm_dir, ["one sentence", "another one"])
    assert emb.shape == (2, 384) and torch.allclose(emb.norm(dim=1), torch.ones(2))


def test_generate_is_greedy_by_default(tiny_factory):
    src = tiny_factory("qwen3", "causal-lm")
    a = pipelines.generate(src, "the king", max_new_tokens=6)
    b = pipelines.generate(src, "the king", max_new_tokens=6)
    assert a == b and isinstance(a, str)
