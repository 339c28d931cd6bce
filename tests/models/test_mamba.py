"""Mamba: HF -> kiln and kiln -> HF bit for bit with the reference scan (fp32, CPU; tests/models/test_parity.py);
the fast scan within the float32 rounding of it (tests/models/rounding.py), gradients included; the recurrence
kernels' analytic backward; config errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.errors import ConfigError
from kiln.models import AutoConfig, AutoModelForCausalLM, mamba
from kiln.models.auto import from_config
from kiln.models.common.ssm import LinearRecurrence, recurrence
from tests.models.causal_cases import batches, same
from tests.models.rounding import assert_all_within, threads  # noqa: F401 (threads: a fixture)

transformers.logging.set_verbosity_error()
VARIANTS = {"tied": {}, **mamba.TINY.variants}  # the configs the parity harness runs (kiln/models/mamba.py)


def test_checkpoints_load_with_the_reference_scan(tiny_factory):
    """The scan the parity harness (tests/models/test_parity.py) holds bit-identical to transformers."""
    assert AutoModelForCausalLM.from_pretrained(tiny_factory("mamba", "causal-lm")).config.scan == "reference"


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


