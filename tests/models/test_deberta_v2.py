"""DeBERTa-v2/v3 (both-ways parity x five heads x its Tiny variants: tests/models/test_parity.py): DeBERTa's
seqcls loss, gradients through disentangled attention, the lm_predictions head, fill-mask."""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import ConfigError
from kiln.interop.verify import verify_export
from kiln.models import deberta_v2, load_pretrained
from kiln.models.auto import AutoConfig
from tests.models.encoder_cases import batches, labels_for, run_both

CONFIGS = {"v3": {}, **deberta_v2.TINY.variants}  # the tiny default and the variants (kiln/models/deberta_v2.py)


@pytest.mark.parametrize("overrides", [{"legacy": False}, {"tie_word_embeddings": False, "embedding_size": 24}],
                         ids=["lm_predictions", "untied"])
def test_other_mlm_heads(overrides, tiny_factory, tmp_path):
    """legacy=false (lm_predictions.lm_head: matmul + bias) and an untied legacy decoder with its own bias."""
    src = tiny_factory("deberta-v2", "masked-lm", **overrides)
    hf = transformers.DebertaV2ForMaskedLM.from_pretrained(src).eval()
    ours = load_pretrained(src)
    run_both(ours, hf, "masked-lm", token_types=hf.config.type_vocab_size > 0, long=True)
    checks = verify_export(ours.save_pretrained(tmp_path / "export"), source=src)
    assert all(ch.ok for ch in checks), [ch.line() for ch in checks if not ch.ok]


@pytest.mark.parametrize("num_labels,labels", [
    (3, torch.tensor([2, -1, 0, 1])),                               # a negative label is skipped
    (3, torch.tensor([-1, -1, -1, -1])),                            # nothing labelled: loss 0
    (3, torch.softmax(torch.arange(12.0).view(4, 3), -1)),          # soft labels
    (1, torch.tensor([0.5, -1.0, 2.0, 0.0])),                       # one label: regression, flat logits
], ids=["ignored", "none", "soft", "regression"])
def test_sequence_classification_loss_without_problem_type(num_labels, labels, tiny_factory):
    src = tiny_factory("deberta-v2", "sequence-classification", num_labels=num_labels)
    hf = transformers.DebertaV2ForSequenceClassification.from_pretrained(src).eval()
    ours = load_pretrained(src)
    assert ours.config.problem_type is None
    batch = batches(hf.config.vocab_size, 0, True)[1]
    with torch.no_grad():
        a, b = ours(**batch, labels=labels), hf(**batch, labels=labels)
    assert a.logits.shape == b.logits.shape and torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss), (a.loss, b.loss)


@pytest.mark.parametrize("config", ["v3", "v2-conv"])
def test_gradients_match_transformers(config, tiny_factory):
    """Backward through disentangled attention (and the conv) gives HF's gradients, bit for bit; the
    autograd path (HF's shapes) and the no-grad path (windowed table) give the same outputs."""
    src = tiny_factory("deberta-v2", "masked-lm", **CONFIGS[config])
    hf = transformers.DebertaV2ForMaskedLM.from_pretrained(src).eval()
    ours = load_pretrained(src)
    batch = batches(hf.config.vocab_size, 0, False)[0]  # 7 tokens: the no-grad path uses a window of the table
    labels = labels_for("masked-lm", batch, 0, hf.config.vocab_size)
    with torch.no_grad():
        no_grad = ours(**batch, **labels)
    a, b = ours(**batch, **labels), hf(**batch, **labels)
    assert torch.equal(a.logits, no_grad.logits) and torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss)
    a.loss.backward()
    b.loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    keymap = ours.family.keymap("masked-lm")
    for name, p in ours.named_parameters():
        hf_name = keymap.hf_name(name)
        if hf_name == "cls.predictions.decoder.weight" or hf_name not in hf_grads:  # tied: under the embeddings
            continue
        assert torch.equal(p.grad, hf_grads[hf_name]), hf_name


def test_config_errors():
    with pytest.raises(ConfigError, match=r"pooler_hidden_size \(16\) must equal hidden_size \(32\)"):
        AutoConfig.for_model("deberta-v2", hidden_size=32, num_attention_heads=4, pooler_hidden_size=16)
    with pytest.raises(ConfigError, match="conv_kernel_size must be odd"):
        AutoConfig.for_model("deberta-v2", conv_kernel_size=4)


def test_config_round_trip_omits_unset_optional_sizes(tiny_factory, tmp_path):
    """Keys HF reads by getattr default are not written as null (HF would read null, not the default)."""
    import json

    src = tiny_factory("deberta-v2", "base")
    out = load_pretrained(src).save_pretrained(tmp_path / "e")
    cfg = json.loads((out / "config.json").read_text())
    assert "embedding_size" not in cfg and "attention_head_size" not in cfg
    assert cfg["pos_att_type"] == ["p2c", "c2p"] and cfg["position_buckets"] == 8 and cfg["share_att_key"] is True


def test_fill_mask_cli(tiny_factory):
    src = tiny_factory("deberta-v2", "masked-lm")
    r = CliRunner().invoke(app, ["fill-mask", str(src), "paris is the [MASK] of france", "-k", "3"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.count("paris is the") == 3, r.output
