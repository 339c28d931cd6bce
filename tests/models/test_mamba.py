"""Mamba: HF -> kiln and kiln -> HF bit for bit with the reference scan (fp32, CPU); the fast scan within the
float32 rounding of it (tests/models/rounding.py), gradients included; the recurrence kernels' analytic
backward; config errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.errors import ConfigError
from kiln.interop.export import export_model
from kiln.interop.matrix import run_cell
from kiln.interop.verify import verify_export
from kiln.models import AutoConfig, AutoModel, AutoModelForCausalLM
from kiln.models.auto import from_config
from kiln.models.common.ssm import LinearRecurrence, recurrence

from tests.models.causal_cases import batches, same
from tests.models.rounding import assert_all_within, threads  # noqa: F401 (threads: a fixture)

transformers.logging.set_verbosity_error()
VARIANTS = {"tied": {}, "untied-biased": dict(tie_word_embeddings=False, use_bias=True, use_conv_bias=False,
                                              time_step_rank=3, expand=3, residual_in_fp32=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_lm_reference_scan_bit_identical_both_ways(variant, tiny_factory, tmp_path):
    src = tiny_factory("mamba", "causal-lm", **VARIANTS[variant])
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert ours.config.scan == "reference"
    assert ours.load_report.ignored == [] and ours.load_report.initialized == []
    with torch.no_grad():
        for i, batch in enumerate(batches()):
            a, b = ours(**batch), hf(**batch)
            same(a.logits, b.logits, f"batch {i} logits")
            if "labels" in batch:
                same(a.loss, b.loss, f"batch {i} loss")
    out = export_model(ours, tmp_path / "export")
    checks = verify_export(out, source=src)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]


def test_base_model_and_training_mode_gradients_bit_identical(tiny_factory):
    src = tiny_factory("mamba", "causal-lm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).train()
    ours = AutoModelForCausalLM.from_pretrained(src).train()
    batch = batches()[2]
    ours(**batch).loss.backward()
    hf(**batch).loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        same(p.grad, hf_params["backbone." + name[len("model."):]].grad, f"grad {name}")
    base_src = tiny_factory("mamba", "base")
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        a = AutoModel.from_pretrained(base_src)(**inputs).last_hidden_state
        b = transformers.AutoModel.from_pretrained(base_src)(**inputs).last_hidden_state
    same(a, b, "base last_hidden_state")


@pytest.mark.parametrize("head", ["base", "causal-lm"])
def test_verify_matrix_rows(head, tmp_path):
    cell = run_cell("mamba", head, None, tmp_path)
    assert cell.ok and cell.max_diff == 0.0, cell.detail


def test_state_spaces_embedding_name_is_read(tiny_factory, tmp_path):
    from kiln.hub import load_weights, save_weights

    src = tiny_factory("mamba", "causal-lm")
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((src / "config.json").read_text())
    save_weights(old, {k.replace("embeddings.", "embedding."): v for k, v in load_weights(src).items()})
    a = AutoModelForCausalLM.from_pretrained(old)
    b = AutoModelForCausalLM.from_pretrained(src)
    ids = batches()[1]["input_ids"]
    with torch.no_grad():
        same(a(input_ids=ids).logits, b(input_ids=ids).logits, "logits via `embedding.`")
    assert "backbone.embeddings.weight" in a.hf_state_dict()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_scan_matches_reference_with_gradients(variant, tiny_factory, threads):
    src = tiny_factory("mamba", "causal-lm", **VARIANTS[variant])
    batch = batches()[2]

    def step(model) -> dict:
        out = model.train()(**batch)
        out.loss.backward()
        return {"logits": out.logits, "loss": out.loss, **{n: p.grad for n, p in model.named_parameters()}}

    ref = step(AutoModelForCausalLM.from_pretrained(src))
    fast = step(AutoModelForCausalLM.from_pretrained(src, scan="fast"))
    ref64 = step(AutoModelForCausalLM.from_pretrained(src).double())  # where the exact scan's rounding is measured
    assert_all_within(fast, ref, ref64, batch["input_ids"].numel(), f"mamba {variant}")


@pytest.mark.parametrize("parallel", [False, True])
def test_recurrence_kernels_and_analytic_backward(parallel):
    g = torch.Generator().manual_seed(0)
    a = torch.rand(9, 2, 3, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(9, 2, 3, dtype=torch.float64, generator=g).requires_grad_()
    h, want = recurrence(a, b, parallel=parallel), torch.zeros_like(b)
    state = torch.zeros(2, 3, dtype=torch.float64)
    for t in range(9):
        state = a[t] * state + b[t]
        want[t] = state
    torch.testing.assert_close(h, want)
    assert torch.autograd.gradcheck(lambda x, y: LinearRecurrence.apply(x, y, parallel), (a, b))


def test_from_config_init_and_config_errors():
    cfg = AutoConfig.for_model("mamba", vocab_size=50, hidden_size=16, num_hidden_layers=2, state_size=4, scan="fast")
    model = from_config(cfg, task="causal-lm", seed=0)
    mixer = model.model.layers[0].mixer
    torch.testing.assert_close(mixer.A_log[3], torch.log(torch.arange(1.0, 5.0)))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert bool(((dt > 0.9e-3) & (dt < 0.11)).all()), "dt must start inside [time_step_min, time_step_max]"
    assert cfg.to_dict()["intermediate_size"] == 32 and "scan" not in cfg.to_dict()
    assert cfg.to_dict()["time_step_rank"] == 1
    with pytest.raises(ConfigError, match=r"scan 'fastest' is not one of: reference, fast"):
        AutoConfig.for_model("mamba", scan="fastest")
    with pytest.raises(ConfigError, match=r"time_step_rank must be 'auto' or a positive integer, got 'big'"):
        AutoConfig.for_model("mamba", time_step_rank="big")
    with pytest.raises(ConfigError, match=r"pass exactly one of input_ids or inputs_embeds"):
        model()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_equals_transformers(variant, tiny_factory):
    # kiln's Mamba keeps no decoding cache: each step re-reads the sequence; transformers steps its
    # recurrent state. The tokens must be the same, and so must a forward over the generated rows.
    src = tiny_factory("mamba", "causal-lm", **VARIANTS[variant])
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ours = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.randint(4, 99, (2, 6), generator=torch.Generator().manual_seed(5))
    a = ours.generate(ids, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    b = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                    eos_token_id=None, pad_token_id=0)
    assert a.shape == (2, 18) and torch.equal(a, b), (a.tolist(), b.tolist())
    with torch.no_grad():
        same(ours(a).logits, hf(a).logits, "logits over the generated sequence")
