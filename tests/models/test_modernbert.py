"""ModernBERT x five heads: HF -> kiln and kiln -> HF bit for bit (fp32, CPU), gradients included; global and
local (sliding window) layers, both poolings, biases on and off, untied and sparse MLM heads, legacy config keys."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import ConfigError
from kiln.interop.matrix import run_matrix
from kiln.interop.tiny import make_tiny
from kiln.models.tasks import get_task
from kiln.models import AutoModelForMaskedLM, load_pretrained
from kiln.models.auto import AutoConfig

from tests.models.encoder_cases import HEADS, assert_same, batches, labels_for, run_both

CONFIGS = {
    # the tiny default: global / local / global layers, window |i - j| <= 4, no biases, CLS pooling, tied decoder
    "tiny": {},
    # every bias on, mean pooling, no decoder bias, explicit layer_types (local first) and rope thetas per type,
    # a window (|i - j| <= 8) longer than the short row: the unmasked SDPA path on the local layer
    "biased-mean": {"attention_bias": True, "mlp_bias": True, "norm_bias": True, "classifier_bias": True,
                    "decoder_bias": False, "classifier_pooling": "mean", "local_attention": 16,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}},
                    "hidden_activation": "gelu_pytorch_tanh", "classifier_activation": "silu"},
}


def _no_key_trouble(info: dict) -> bool:
    return not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("task", HEADS)
def test_round_trip_bit_exact(task, config, tmp_path):
    src = make_tiny("modernbert", task, tmp_path / "src", **CONFIGS[config])  # (lists and dicts: no factory cache)
    auto = getattr(transformers, get_task(task).hf_auto)
    hf = auto.from_pretrained(src).eval()
    assert hf.config._attn_implementation == "sdpa"  # what transformers runs on CPU by default: what kiln matches
    ours = load_pretrained(src)
    assert ours.family.model_type == "modernbert" and ours.task == task
    run_both(ours, hf, task, token_types=False, long=True)  # HF -> kiln

    ours.save_pretrained(tmp_path / "export")
    back, info = auto.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert _no_key_trouble(info), info
    assert type(back).__name__ == type(hf).__name__
    run_both(ours, back.eval(), task, token_types=False, long=True)  # kiln -> HF


def _grads(model, names) -> dict:
    return {names(n): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("task", HEADS)
def test_gradients_match_transformers_both_ways(task, tiny_factory, tmp_path):
    """Backward over a padded batch (masked pads, local windows) gives HF's gradients bit for bit, against the
    source checkpoint and against kiln's export of it."""
    src = tiny_factory("modernbert", task)
    auto = getattr(transformers, get_task(task).hf_auto)
    ours = load_pretrained(src)
    ours.save_pretrained(tmp_path / "export")
    keymap = ours.family.keymap(task)
    batch = batches(99, 0, False, long=True)[2]  # 40 tokens, one row padded from 25
    batch = {**batch, **labels_for(task, batch, 3, 99)}
    weight = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(3))

    def backward(model):
        model.zero_grad()
        out = model(**batch)
        loss = getattr(out, "loss", None)
        (loss if loss is not None else (out.last_hidden_state * weight).sum()).backward()
        return out

    ours_out = backward(ours)
    ours_grads = _grads(ours, keymap.hf_name)
    for hf_dir in (src, tmp_path / "export"):
        hf = auto.from_pretrained(hf_dir).eval()
        assert_same(ours_out, backward(hf))
        theirs = _grads(hf, lambda n: n)
        assert set(ours_grads) <= set(theirs), sorted(set(ours_grads) - set(theirs))
        for name, g in ours_grads.items():
            assert torch.equal(g, theirs[name]), f"{hf_dir.name}: grad of {name}"
        # every HF gradient is matched (the tied decoder's lives under the word embeddings in both)
        assert set(theirs) - set(ours_grads) <= {"decoder.weight"}


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


def test_verify_matrix_rows():
    """The verify-matrix cells of the family (from TINY): build with transformers, export with kiln, verify."""
    cells = run_matrix([("modernbert", head, None) for head in HEADS])
    assert [c.head for c in cells] == HEADS
    assert all(c.ok and c.max_diff == 0.0 for c in cells), [(c.head, c.detail) for c in cells if not c.ok]


def test_fill_mask_cli(tiny_factory):
    src = tiny_factory("modernbert", "masked-lm")
    r = CliRunner().invoke(app, ["fill-mask", str(src), "paris is the [MASK] of france", "-k", "3"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.count("paris is the") == 3, r.output
