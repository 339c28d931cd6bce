"""Llama, Qwen2, Qwen3, Qwen3-MoE beyond the both-ways parity (tests/models/test_parity.py): EOS stops, seeded
sampling and its filters, the stacked-expert key map and export, tied embeddings, unsupported options named, the
MoE aux loss in the Trainer's step."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.errors import WeightsError
from kiln.interop.export import export_model
from kiln.models import AutoModelForCausalLM
from kiln.models.keymap import KeyMap, Stack
from tests.models.causal_cases import batches

transformers.logging.set_verbosity_error()


def test_generation_stops_at_eos_and_pads_finished_rows(tiny_factory):
    model = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3", "causal-lm"))
    ids = torch.randint(4, 99, (2, 5), generator=torch.Generator().manual_seed(0))
    free = model.generate(ids, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, 5])  # row 0's first new token becomes the EOS
    out = model.generate(ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    assert out[0, 5] == eos and (out[0, 6:] == 0).all()
    hits = (free[1, 5:] == eos).nonzero().flatten().tolist()
    n = hits[0] + 1 if hits else 8  # row 1 runs until its own EOS (or the limit); then everything stops
    assert out.shape[1] == 5 + n and torch.equal(out[1, 5:], free[1, 5:5 + n])


def test_sampling_is_seeded_and_filters_apply(tiny_factory):
    from kiln.models.generation import filter_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_factory("llama", "causal-lm"))
    ids = torch.randint(4, 99, (1, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=20, top_p=0.9, eos_token_id=None)
    assert torch.equal(model.generate(ids, seed=7, **kw), model.generate(ids, seed=7, **kw))
    outs = {tuple(model.generate(ids, seed=s, **kw)[0].tolist()) for s in range(4)}
    assert len(outs) > 1
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    # softmax = .64 .24 .09 .03 .01: top_p .8 keeps the two whose mass reaches it
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True, True]]


def test_moe_export_writes_one_tensor_per_expert(tiny_factory, tmp_path):
    from safetensors import safe_open

    ours = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_moe", "causal-lm"))
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 32, 32)  # (E, 2I, C)
    out = export_model(ours, tmp_path / "moe")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")} <= keys
    assert not any("gate_up_proj" in k for k in keys)


def test_stack_rule_round_trip_and_missing_expert_named():
    km = KeyMap([Stack("l.{}.gu", ("L.{}.e.{}.g.weight", "L.{}.e.{}.u.weight")), ("l.{}.x", "L.{}.x")]).prefixed("m", "M")
    t = torch.arange(3 * 4 * 2, dtype=torch.float32).view(3, 4, 2)  # 3 experts, gate rows 0-1, up rows 2-3
    hf, unmatched = km.to_hf({"m.l.5.gu": t, "m.l.5.x.bias": torch.ones(1)})
    assert unmatched == [] and len(hf) == 7
    assert torch.equal(hf["M.L.5.e.2.u.weight"], t[2, 2:])
    back, _ = km.to_kiln(hf)
    assert torch.equal(back["m.l.5.gu"], t)
    assert km.kiln_name(km.hf_name("m.l.5.gu")) == "m.l.5.gu"
    del hf["M.L.5.e.1.g.weight"]
    with pytest.raises(WeightsError, match=r"'M\.L\.5\.e\.1\.g\.weight'"):
        km.to_kiln(hf)


def test_tied_embeddings_have_no_lm_head_tensor(tiny_factory, tmp_path):
    ours = AutoModelForCausalLM.from_pretrained(tiny_factory("llama", "causal-lm"))
    assert ours.config.tie_word_embeddings and ours.lm_head is None
    assert "lm_head.weight" not in ours.hf_state_dict()


def test_unsupported_rope_and_sliding_window_are_named(tiny_factory, tmp_path):
    import json
    import shutil

    from kiln.errors import ConfigError

    src = tiny_factory("qwen2", "causal-lm")
    for change, msg in (({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
                        ({"use_sliding_window": True}, "use_sliding_window")):
        d = tmp_path / msg.split()[0].strip("'")
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=msg):
            AutoModelForCausalLM.from_pretrained(d)


def test_trainer_step_adds_moe_aux_loss_as_transformers_does(tiny_factory):
    from kiln.train.steps import default_step

    src = tiny_factory("qwen3_moe", "causal-lm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, output_router_logits=True).eval()
    ours = AutoModelForCausalLM.from_pretrained(src, output_router_logits=True)
    batch = batches()[1]
    with torch.no_grad():
        loss_sum, count = default_step(ours, batch)
        want = hf(**batch).loss
    assert ours(**batch).aux_loss > 0
    torch.testing.assert_close(loss_sum / count, want, rtol=1e-6, atol=1e-6)
