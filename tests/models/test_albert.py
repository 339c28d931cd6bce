"""ALBERT: layer sharing, the untied decoder, fill-mask (both-ways parity x five heads: tests/models/test_parity.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import ConfigError
from kiln.interop.verify import verify_export
from kiln.models import load_pretrained
from kiln.models.auto import AutoConfig
from tests.models.encoder_cases import batches


def test_untied_decoder_keeps_its_own_bias(tiny_factory, tmp_path):
    """tie_word_embeddings=false: HF's decoder has its own weight and bias; predictions.bias goes unused."""
    src = tiny_factory("albert", "masked-lm", tie_word_embeddings=False)
    ours = load_pretrained(src)
    assert ours.head.decoder is not None and ours.head.decoder.bias is not None
    hf = transformers.AlbertForMaskedLM.from_pretrained(src).eval()
    batch = batches(hf.config.vocab_size, 0, True)[1]
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, hf(**batch).logits)
    checks = verify_export(ours.save_pretrained(tmp_path / "e"), source=src)
    assert all(ch.ok for ch in checks), [ch.line() for ch in checks if not ch.ok]


def test_layers_share_weights(tiny_factory):
    """Parameters scale with groups x inner layers, not with num_hidden_layers; depth still changes outputs."""
    src = tiny_factory("albert", "base", num_hidden_groups=1, inner_group_num=1, num_hidden_layers=4)
    four = load_pretrained(src)
    two = load_pretrained(src, num_hidden_layers=2)
    assert len(four.model.layers) == 1 and len(four.model.layers[0]) == 1
    assert four.num_parameters() == two.num_parameters()
    ids = torch.tensor([[2, 9, 17, 3]])
    with torch.no_grad():
        assert not torch.equal(four(input_ids=ids).last_hidden_state, two(input_ids=ids).last_hidden_state)


def test_bad_group_count_is_a_config_error():
    with pytest.raises(ConfigError, match=r"num_hidden_groups \(3\) must be between 1 and num_hidden_layers \(2\)"):
        AutoConfig.for_model("albert", num_hidden_layers=2, num_hidden_groups=3)


def test_fill_mask_cli(tiny_factory):
    src = tiny_factory("albert", "masked-lm")
    r = CliRunner().invoke(app, ["fill-mask", str(src), "paris is the [MASK] of france", "-k", "3"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.count("paris is the") == 3, r.output
