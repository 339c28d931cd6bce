"""ModernBERT: global and local (sliding window) layers, both poolings, biases on and off (its Tiny variants, run
both ways with gradients by tests/models/test_parity.py), untied and sparse MLM heads, legacy config keys."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import ConfigError
from kiln.models import AutoModelForMaskedLM, load_pretrained
from kiln.models.auto import AutoConfig
from tests.models.encoder_cases import batches, labels_for, run_both


def test_transformers_runs_sdpa_on_cpu(tiny_factory):
    """The attention transformers runs on CPU by default, which kiln matches bit for bit (test_parity)."""
    hf = transformers.AutoModel.from_pretrained(tiny_factory("modernbert", "base"))
    assert hf.config._attn_implementation == "sdpa"


def _no_key_trouble(info: dict) -> bool:
    return not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


def _grads(model, names) -> dict:
    return {names(n): p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_local_window_is_exercised(tiny_factory):
    """Control: the same weights with a wider local window differ from HF, so the window is really applied."""
    src = tiny_factory("modernbert", "base")
    hf = transformers.AutoModel.from_pretrained(src).eval()
    wide = load_pretrained(src, local_attention=64)
    batch = batches(99, 0, False, long=True)[2]
    with torch.no_grad():
        a, b = wide(**batch).last_hidden_state, hf(**batch).last_hidden_state
    assert not torch.equal(a, b)


@pytest.mark.parametrize("overrides", [{"tie_word_embeddings": False}, {"sparse_prediction": True}],
                         ids=["untied", "sparse"])
def test_other_mlm_heads(overrides, tiny_factory, tmp_path):
    """An untied decoder (its own weight beside the bias), and sparse prediction (logits at labelled rows only)."""
    src = tiny_factory("modernbert", "masked-lm", **overrides)
    hf = transformers.ModernBertForMaskedLM.from_pretrained(src).eval()
    ours = load_pretrained(src)
    run_both(ours, hf, "masked-lm", token_types=False, long=True)
    if overrides.get("sparse_prediction"):
        batch = batches(99, 0, False)[1]
        labels = labels_for("masked-lm", batch, 0, 99)["labels"]
        with torch.no_grad():
            out = ours(**batch, labels=labels)
        assert out.logits.shape == (int((labels != -100).sum()), 99)
    ours.save_pretrained(tmp_path / "export")
    back, info = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert _no_key_trouble(info), info
    run_both(ours, back.eval(), "masked-lm", token_types=False, long=True)


def test_legacy_config_keys(tiny_factory, tmp_path):
    """A config.json as on the Hub before layer_types / rope_parameters: every-n-th global layer, two thetas."""
    src = tmp_path / "legacy"
    shutil.copytree(tiny_factory("modernbert", "masked-lm"), src)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del cfg[key]
    cfg.update(global_attn_every_n_layers=3, global_rope_theta=2000.0, local_rope_theta=500.0)
    (src / "config.json").write_text(json.dumps(cfg))
    hf = transformers.ModernBertForMaskedLM.from_pretrained(src).eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ours = load_pretrained(src)
    assert ours.config.attention_types == hf.config.layer_types
    run_both(ours, hf, "masked-lm", token_types=False, long=True)
    exported = json.loads((ours.save_pretrained(tmp_path / "export") / "config.json").read_text())
    assert "layer_types" not in exported and exported["global_rope_theta"] == 2000.0  # written back as read


def test_fresh_model_uses_modernbert_init():
    """from_config: truncated normals (|w| <= cutoff * std), output projections scaled by depth, zero decoder bias."""
    config = AutoConfig.for_model("modernbert", vocab_size=99, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=4, intermediate_size=37, pad_token_id=0, decoder_bias=True)
    model = AutoModelForMaskedLM.from_config(config, seed=0)
    std, cut = config.initializer_range, config.initializer_cutoff_factor
    qkv = model.model.layers[1].attn.qkv_proj.weight
    out_std = std / (2.0 * 3) ** 0.5
    assert qkv.abs().max() <= cut * std and model.model.layers[1].mlp.down_proj.weight.abs().max() <= cut * out_std
    assert torch.count_nonzero(model.head.bias) == 0
    out = model(input_ids=torch.tensor([[2, 7, 9, 4, 3]]), labels=torch.tensor([[-100, -100, -100, 9, -100]]))
    assert out.logits.shape == (1, 5, 99) and torch.isfinite(out.loss)


def test_config_errors():
    with pytest.raises(ConfigError, match="classifier_pooling must be 'cls' or 'mean', got 'max'"):
        AutoConfig.for_model("modernbert", classifier_pooling="max")
    with pytest.raises(ConfigError, match="layer_types has 2 entries but num_hidden_layers is 3"):
        AutoConfig.for_model("modernbert", num_hidden_layers=3, layer_types=["full_attention"] * 2)
    with pytest.raises(ConfigError, match=r"layer_types \['chunked_attention'\] not supported"):
        AutoConfig.for_model("modernbert", num_hidden_layers=1, layer_types=["chunked_attention"])
    with pytest.raises(ConfigError, match=r"\(sliding_attention\): rope_type 'dynamic' is not supported"):
        AutoConfig.for_model("modernbert", rope_parameters={"sliding_attention": {"rope_type": "dynamic"}})


def test_fill_mask_cli(tiny_factory):
    src = tiny_factory("modernbert", "masked-lm")
    r = CliRunner().invoke(app, ["fill-mask", str(src), "paris is the [MASK] of france", "-k", "3"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.count("paris is the") == 3, r.output
