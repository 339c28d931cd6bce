"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text and image-text checkpoints): HF -> kiln -> HF bit for bit on the
exact delta rule (logits, loss, gradients, greedy decoding: tests/models/test_parity.py); the fast chunked rule
within float32 rounding of it and of float64 (an estimate per tensor, tests/models/rounding.py) on 64, 1000 and 4096
tokens with 1 and 2 threads; packed rows restart the DeltaNet state per
sample; vision tower and MTP tensors round-trip; LoRA on the DeltaNet projections loads in PEFT."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError
from kiln.interop.export import export_model
from kiln.interop.verify import verify_export
from kiln.models import AutoConfig, AutoModelForCausalLM
from kiln.models.auto import from_config
from kiln.models.common import delta_rule
from kiln.models.common.hybrid import HybridCache
from tests.models.causal_cases import batches, same
from tests.models.rounding import (  # noqa: F401
    assert_all_within,
    assert_within,
    rounding_error,
    threads,  # (threads: a fixture)
)

transformers.logging.set_verbosity_error()
HYBRIDS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"]
IMAGE_TEXT = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_tiny_checkpoints_take_both_mixers_and_their_mlps(model_type, tiny_factory):
    """What the parity harness (tests/models/test_parity.py) runs these families on: a DeltaNet layer, then
    gated attention; the shared expert's gate or the dense MLP trains."""
    ours = AutoModelForCausalLM.from_pretrained(tiny_factory(model_type, "causal-lm"))
    assert hasattr(ours.model.layers[0], "linear_attn") and hasattr(ours.model.layers[1], "self_attn")
    names = [n for n, _ in ours.named_parameters()]
    assert any("linear_attn.A_log" in n for n in names)
    assert any("shared_expert_gate" in n or "mlp.up_proj" in n for n in names)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe"])
def test_hybrid_cache_contents_and_fast_rule_decoding(model_type, tiny_factory):
    """The cache holds the conv window and recurrent state for DeltaNet layers, keys for attention ones (its
    steps equal transformers': test_parity); the fast rule also serves prefill and multi-token continuation."""
    src = tiny_factory(model_type, "causal-lm")
    ours = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 99, (2, 7), generator=g)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # a left-padded row in the batch
    cache = ours.model.new_cache()
    assert isinstance(cache, HybridCache)
    with torch.no_grad():
        for s, e in [(0, 3), (3, 4), (4, 7)]:
            ours(ids[:1, s:e], cache=cache)
    assert cache.conv_states[0].shape[-1] == 4 and cache.recurrent_states[0].shape == (1, 4, 8, 8)
    assert len(cache) == 7 and cache.keys[0] is None and cache.keys[1].shape[-2] == 7
    fast = delta_rule.set_fast(AutoModelForCausalLM.from_pretrained(src))
    kw = {"input_ids": ids, "attention_mask": attn}
    assert torch.equal(fast.generate(**kw, max_new_tokens=20, eos_token_id=None, pad_token_id=0),
                       ours.generate(**kw, max_new_tokens=20, eos_token_id=None, pad_token_id=0))
    cache_fast = fast.model.new_cache()
    with torch.no_grad():
        parts = [fast(ids[:1, s:e], cache=cache_fast).logits for s, e in [(0, 3), (3, 4), (4, 7)]]
        ref, ref64 = ours(ids[:1]).logits, AutoModelForCausalLM.from_pretrained(src).double()(ids[:1]).logits
    e = rounding_error(ref, ref64, ours.config.intermediate_size)  # the longest sum behind a logit
    assert_within(torch.cat(parts, 1), ref, e, "fast cached continuation logits")


def _run(src, T: int, fast: bool, dtype: torch.dtype = torch.float32):
    """Logits, loss and gradients (as float64) of a training step on 2 rows of T tokens, one left-padded."""
    model = delta_rule.set_fast(AutoModelForCausalLM.from_pretrained(src).train().to(dtype), fast)
    assert all(m.fast_delta_rule == fast for m in model.modules() if hasattr(m, "fast_delta_rule"))
    ids = torch.randint(0, 99, (2, T), generator=torch.Generator().manual_seed(T))
    attn = torch.ones_like(ids)
    attn[1, :5] = 0
    out = model(input_ids=ids, attention_mask=attn, labels=ids)
    out.loss.backward()
    return {"logits": out.logits.double(), "loss": out.loss.double(),
            **{f"grad {n}": p.grad.double() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("T", [64, 1000])
def test_fast_delta_rule_matches_reference_with_gradients(T, tiny_factory, threads):
    src = tiny_factory("qwen3_next", "causal-lm")
    ref, ref64, fast = _run(src, T, fast=False), _run(src, T, False, torch.float64), _run(src, T, fast=True)
    assert_all_within(fast, ref, ref64, 2 * T, f"T={T}", against_float64=False)


@pytest.mark.parametrize("T", [1000, pytest.param(4096, marks=pytest.mark.slow)])
def test_fast_delta_rule_within_fp32_rounding_of_float64(T, tiny_factory, threads):
    """Against the exact rule run in float64: the fast path in float32 is within the rounding the exact path
    itself gets in float32, gradients included (dt_bias and A_log, sums over every token that cancel, carry
    ~200 u of their largest entry there: a fixed 1e-5 relative bound failed on a Xeon)."""
    narrow = {} if T < 4096 else dict(hidden_size=16, intermediate_size=16, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
                                      linear_num_value_heads=2)
    src = tiny_factory("qwen3_5_text", "causal-lm", max_position_embeddings=4096, **narrow)
    ref, ref64, fast = _run(src, T, fast=False), _run(src, T, False, torch.float64), _run(src, T, fast=True)
    assert_all_within(fast, ref, ref64, 2 * T, f"T={T} fast vs float64", against_float64=True)
    # a control that can fail: one gradient off by 1e-3 of its largest entry (a wrong term is far more)
    bad = dict(fast)
    name = "grad model.layers.0.linear_attn.dt_bias"
    bad[name] = fast[name] + 1e-3 * ref64[name].abs().max()
    with pytest.raises(AssertionError, match="dt_bias"):
        assert_all_within(bad, ref, ref64, 2 * T, "control", against_float64=True)


def test_fast_rule_restarts_and_initial_state_against_a_token_loop():
    """The fast rule in float64 (chunks of 4, 2 q/k heads over 4 value heads): equal to the recurrence token by
    token with the state zeroed where a packed sample starts; its analytic backward passes gradcheck."""
    g = torch.Generator().manual_seed(0)
    B, T = 2, 13
    f64 = dict(generator=g, dtype=torch.float64)
    q, k, v = torch.randn(B, T, 2, 3, **f64), torch.randn(B, T, 2, 3, **f64), torch.randn(B, T, 4, 2, **f64)
    decay, beta = -torch.rand(B, T, 4, **f64), torch.rand(B, T, 4, **f64)
    s0 = torch.randn(B, 4, 3, 2, **f64)
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[0, [5, 8]] = True  # row 0: samples [0, 5), [5, 8), [8, 13); row 1: one sample
    out, final = delta_rule.chunk_fast(q, k, v, decay, beta, s0, True, resets, chunk_size=4)
    qn, kn = delta_rule.l2norm(q) * 3**-0.5, delta_rule.l2norm(k)
    for b in range(B):
        for h in range(4):
            s = s0[b, h].clone()
            for t in range(T):
                s = torch.zeros_like(s) if resets[b, t] else s
                s = decay[b, t, h].exp() * s
                kt = kn[b, t, h // 2]
                s = s + torch.outer(kt, beta[b, t, h] * (v[b, t, h] - s.T @ kt))
                torch.testing.assert_close(out[b, t, h], s.T @ qn[b, t, h // 2], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(final[b, h], s, rtol=1e-5, atol=1e-6)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, decay, beta, s0)]
    assert torch.autograd.gradcheck(lambda *x: delta_rule.chunk_fast(*x[:5], x[5], True, resets, chunk_size=4), inputs)


def test_reference_rules_are_transformers_fallbacks_bit_for_bit():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 150, 2, 8, generator=g), torch.randn(2, 150, 2, 8, generator=g)
    v = torch.randn(2, 150, 4, 6, generator=g)
    decay, beta = -torch.rand(2, 150, 4, generator=g), torch.rand(2, 150, 4, generator=g)
    s0 = torch.randn(2, 4, 8, 6, generator=g)
    kw = dict(initial_state=s0, output_final_state=True)
    for ours, theirs in ((delta_rule.chunk_reference, hf.torch_chunk_gated_delta_rule),
                         (delta_rule.recurrent_reference, hf.torch_recurrent_gated_delta_rule)):
        a, b = ours(q, k, v, decay, beta, **kw), theirs(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True, **kw)
        same(a[0], b[0], f"{ours.__name__} out")
        same(a[1], b[1], f"{ours.__name__} state")
    fast = delta_rule.chunk_fast(q, k, v, decay, beta, **kw)
    ref = delta_rule.chunk_reference(q, k, v, decay, beta, **kw)
    ref64 = delta_rule.chunk_reference(*(x.double() for x in (q, k, v, decay, beta)), initial_state=s0.double(),
                                       output_final_state=True)
    for i, what in enumerate(("out", "state")):  # the state sums over all 150 tokens
        assert_within(fast[i], ref[i], rounding_error(ref[i], ref64[i], 150), f"chunk_fast {what}")


@pytest.mark.parametrize("fast", [False, True])
def test_packed_rows_give_each_sample_its_own_loss(fast, tiny_factory):
    model = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_5_moe_text", "causal-lm"))
    delta_rule.set_fast(model, fast)
    model64 = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_5_moe_text", "causal-lm")).double()
    g = torch.Generator().manual_seed(2)
    samples = [torch.randint(4, 99, (n,), generator=g) for n in (9, 3, 14)]  # 3 < the conv window
    packed = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions).logits[0]
        unrestarted = model(input_ids=packed).logits[0]
        start = 0
        for s in samples:
            alone, alone64 = model(input_ids=s[None], labels=s[None]), model64(input_ids=s[None], labels=s[None])
            part = together[start:start + len(s)]
            n = model.config.intermediate_size  # the longest sum behind a logit
            assert_within(part, alone.logits[0], rounding_error(alone.logits[0], alone64.logits[0], n), "logits")
            loss = torch.nn.functional.cross_entropy(part[:-1], s[1:])
            assert_within(loss, alone.loss, rounding_error(alone.loss, alone64.loss, n), "loss")
            start += len(s)
    # control: without restarting positions the later samples see the earlier ones
    assert rel(unrestarted[9:12], together[9:12]) > 1e-3


@pytest.mark.parametrize("model_type", list(IMAGE_TEXT))
def test_image_text_checkpoint_round_trips_vision_and_mtp(model_type, tiny_factory, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_factory(model_type, "causal-lm"), src)
    weights = load_file(str(src / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.randn(32, 64)  # multi-token-prediction layers ship beside the model
    weights["mtp.norm.weight"] = torch.randn(32).to(torch.bfloat16)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert ours.task == "causal-lm" and ours.load_report.ignored == []
    assert set(ours.hf_passthrough) == {k for k in weights if k.startswith("mtp.")}  # the vision tower is live
    out = export_model(ours, tmp_path / "export")
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(weights)
    for k, v in weights.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == [IMAGE_TEXT[model_type]] and cfg["vision_config"] == src_cfg["vision_config"]
    assert cfg["text_config"]["model_type"] == src_cfg["text_config"]["model_type"]
    hf, info = getattr(transformers, IMAGE_TEXT[model_type]).from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    batch = batches()[2]
    with torch.no_grad():
        a, b = ours(**batch), hf.eval()(**batch)
    same(a.logits, b.logits, "ForConditionalGeneration logits")
    same(a.loss, b.loss, "ForConditionalGeneration loss")


def test_text_checkpoint_mtp_layers_round_trip(tiny_factory, tmp_path):
    """Qwen3-Next releases carry `mtp.*` tensors transformers ignores: kiln keeps and writes them back."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_factory("qwen3_next", "causal-lm"), src)
    weights = load_file(str(src / "model.safetensors"))
    weights["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.randn(16, 32).to(torch.bfloat16)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert ours.load_report.ignored == [] and list(ours.hf_passthrough) == ["mtp.layers.0.mlp.experts.0.up_proj.weight"]
    checks = verify_export(export_model(ours, tmp_path / "export"), source=src)  # includes: bytes equal the source
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]


def test_released_moe_layout_with_fused_experts_loads_and_exports_fused(tiny_factory, tmp_path):
    """Qwen3.5-MoE releases store experts fused per layer: gate_up_proj (E, 2I, C), down_proj (E, C, I)."""
    import shutil

    src = tmp_path / "fused"
    shutil.copytree(tiny_factory("qwen3_5_moe", "causal-lm"), src)
    per_expert = load_file(str(src / "model.safetensors"))
    fused = {k: v for k, v in per_expert.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.language_model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{p}.{e}.gate_proj.weight"],
                                                             per_expert[f"{p}.{e}.up_proj.weight"]]) for e in range(4)])
        fused[f"{p}.down_proj"] = torch.stack([per_expert[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    save_file(fused, str(src / "model.safetensors"), metadata={"format": "pt"})
    ours = AutoModelForCausalLM.from_pretrained(src)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(src).eval()
    batch = batches()[2]
    with torch.no_grad():
        same(ours(**batch).logits, hf(**batch).logits, "logits from fused experts")
    out = export_model(ours, tmp_path / "export")
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(fused) and all(torch.equal(back[k], v) for k, v in fused.items())
    _, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info


def test_multimodal_rotary_matches_transformers_on_3d_positions(tiny_factory):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_5_text", "causal-lm"))
    ours = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_5_text", "causal-lm"))
    x = torch.zeros(2, 5, 32)
    pos = torch.randint(0, 50, (3, 2, 5), generator=torch.Generator().manual_seed(0))
    for got, want in zip(ours.model.rotary_emb(x, pos), hf.model.rotary_emb(x, pos)):
        same(got, want, "mrope cos/sin")
    text = pos[0]
    for got, want in zip(ours.model.rotary_emb(x, text), hf.model.rotary_emb(x, text)):
        same(got, want, "text-position cos/sin")
    assert ours.model.rotary_emb(x, text)[0].shape == (2, 5, 4)  # partial rotary: 0.25 of head_dim 16


def test_lora_on_deltanet_projections_loads_in_peft(tiny_factory, tmp_path):
    import peft

    from kiln.models.common.lora import LoraConfig, apply_lora, save_adapter

    src = tiny_factory("qwen3_next", "causal-lm")
    ours = AutoModelForCausalLM.from_pretrained(src)
    chosen = apply_lora(ours, LoraConfig(r=2, alpha=4, targets=["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"]))
    assert chosen == ["model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.in_proj_ba",
                      "model.layers.0.linear_attn.out_proj", "model.layers.1.self_attn.q_proj"]
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    save_adapter(ours, tmp_path / "adapter")
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src), tmp_path / "adapter")
    batch = batches()[1]
    with torch.no_grad():
        a, b = ours.eval()(**batch), hf.eval()(**batch)
    assert rel(a.logits, b.logits) < 1e-6, rel(a.logits, b.logits)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(src)(**batch).logits
    assert rel(a.logits, base) > 1e-4  # the adapters change the output


def test_from_config_init_and_config_errors():
    cfg = AutoConfig.for_model("qwen3_next", vocab_size=50, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                               linear_key_head_dim=4, linear_value_head_dim=4, num_experts=2, num_experts_per_tok=1,
                               moe_intermediate_size=8, shared_expert_intermediate_size=8, full_attention_interval=2)
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2 and "full_attention_interval" not in cfg.extra
    model = from_config(cfg, task="causal-lm", seed=0)
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.zeros(16))  # zero-centred: scale 1 + w starts at 1
    assert torch.equal(layer.linear_attn.norm.weight, torch.ones(4)) and torch.equal(layer.linear_attn.dt_bias,
                                                                                      torch.ones(2))
    assert bool((layer.linear_attn.A_log.exp() >= 0.0099).all() and (layer.linear_attn.A_log.exp() <= 16).all())
    assert torch.isfinite(model(input_ids=torch.arange(10)[None], labels=torch.arange(10)[None]).loss)
    with pytest.raises(ConfigError, match=r"layer_types has 2 entries but num_hidden_layers is 3"):
        AutoConfig.for_model("qwen3_5_text", num_hidden_layers=3, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"layer_types has unsupported kind\(s\) \['sliding_attention'\]"):
        AutoConfig.for_model("qwen3_5_text", num_hidden_layers=1, layer_types=["sliding_attention"])
    with pytest.raises(ConfigError, match=r"linear_num_value_heads \(6\) must be a multiple of "
                                          r"linear_num_key_heads \(4\)"):
        AutoConfig.for_model("qwen3_next", linear_num_key_heads=4, linear_num_value_heads=6)
