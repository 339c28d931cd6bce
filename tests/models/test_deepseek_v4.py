"""DeepSeek-V4: bit-identical to transformers (fp32, CPU) in logits, loss, router logits and every gradient, both
load directions (tests/models/test_parity.py), on a tiny config with a sliding-only, a CSA (indexer) and an HCA layer, hash and top-k routing
and three hyper-connected streams; cached greedy and sampled generation across prompts longer than the window;
MTP tensors kept byte for byte; LoRA loads in PEFT; config errors named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError, KilnError
from kiln.interop.verify import compare_weights
from kiln.models import AutoModelForCausalLM
from kiln.models.common.compressor import SlidingCompressedCache
from kiln.models.common.hash_moe import HashRouter, ScoredTopKRouter
from tests.models.causal_cases import batches, model_pair, same

transformers.logging.set_verbosity_error()


@pytest.fixture
def ckpt(tiny_factory):
    """make(task="causal-lm"): the tiny checkpoint, with random balancing biases and a random hash table (distinct
    experts per token: deepseek_v4.random_routing), so a bias or table dropped or misread changes the experts."""
    return lambda task="causal-lm": tiny_factory("deepseek_v4", task)


_pair = model_pair


def test_tiny_config_switches_every_layer_kind_on(ckpt):
    ours = AutoModelForCausalLM.from_pretrained(ckpt())
    c = ours.config
    assert c.attention_kinds() == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert [type(layer.mlp.gate) for layer in ours.model.layers] == [HashRouter, ScoredTopKRouter, ScoredTopKRouter]
    assert c.hc_mult == 3 and c.ropes()["compress"]["rope_type"] == "yarn"
    assert c.sliding_window < batches()[1]["input_ids"].shape[1]  # the test rows outgrow the window
    assert c.index_topk < batches()[1]["input_ids"].shape[1] // c.rates()["compressed_sparse_attention"]


def test_parameter_names_and_which_parts_train(ckpt):
    """What the parity harness (tests/models/test_parity.py) compares: the same in-memory names as transformers;
    the indexer picks entries (no gradient), the hyper-connections train; top-k layers count expert load."""
    ours, hf = _pair(ckpt())
    assert set(dict(ours.named_parameters())) == set(dict(hf.named_parameters()))
    ours.train()
    batch = batches()[2]
    ours(**batch).loss.backward()
    assert ours.model.layers[1].self_attn.compressor.indexer.q_b_proj.weight.grad is None
    assert ours.model.layers[1].attn_hc.fn.grad is not None and ours.model.hc_head.hc_fn.grad is not None
    loads = [layer.mlp.gate.expert_load for layer in ours.model.layers[1:]]
    assert all(int(load.sum()) == batch["input_ids"].numel() * ours.config.num_experts_per_tok for load in loads)


@pytest.mark.parametrize("overrides", [
    # other rates (windows of 4 and 8 over 13 tokens: partial windows left over), sigmoid scores, plain rope,
    # two streams, two CSA layers (the second after HCA), every layer top-k, an indexer keeping one entry
    dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, scoring_func="sigmoid",
         rope_parameters=None, hc_mult=2, num_hidden_layers=4, index_topk=1, sliding_window=6,
         layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                      "sliding_attention"], mlp_layer_types=["moe"] * 4),
    # one stream, windows longer than some rows, DeepSeek's legacy per-layer compress_ratios / num_hash_layers
    dict(hc_mult=1, hc_sinkhorn_iters=1, layer_types=None, mlp_layer_types=None, compress_ratios=[128, 4, 0],
         num_hash_layers=2, compress_rates=None, compress_rate_csa=4, compress_rate_hca=16),
], ids=["rates-4-8-sigmoid", "legacy-keys-one-stream"])
def test_other_schedules_bit_identical_with_gradients(overrides, tmp_path):
    from kiln.interop.tiny import make_tiny

    src = make_tiny("deepseek_v4", "causal-lm", tmp_path / "m", tokenizer=False, **overrides)
    ours, hf = _pair(src)
    assert ours.config.attention_kinds() == hf.config.layer_types and ours.config.rates() == hf.config.compress_rates
    ours.train(), hf.train()
    for batch in batches()[1:]:
        a, b = ours(**batch), hf(**batch)
        same(a.logits, b.logits, "logits")
        a.loss.backward()
        b.loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None:
            same(p.grad, theirs[name].grad, f"grad {name}")


def test_bfloat16_keeps_the_same_parts_float32_and_stays_bit_identical(ckpt):
    src = ckpt()
    ours = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    theirs = dict(hf.named_parameters())
    assert {n: p.dtype for n, p in ours.named_parameters()} == {n: p.dtype for n, p in theirs.items()}
    assert ours.model.layers[0].attn_hc.fn.dtype == torch.float32 and ours.lm_head.weight.dtype == torch.bfloat16
    ours.train(), hf.train()
    batch = batches()[2]
    a, b = ours(**batch), hf(**batch)
    same(a.logits, b.logits, "bf16 logits")
    a.loss.backward()
    b.loss.backward()
    for name, p in ours.named_parameters():
        if p.grad is not None:
            same(p.grad, theirs[name].grad, f"bf16 grad {name}")


def test_sliding_and_compressed_caches_step_like_transformers(ckpt):
    ours, hf = _pair(ckpt(), eos=False)
    ids = torch.randint(4, 99, (2, 11), generator=torch.Generator().manual_seed(5))  # 11 > window 4
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # a left-padded row: its pads are pooled into compressed entries, as in transformers
    # (greedy tokens over these prompts equal transformers': test_parity)
    from transformers import DynamicCache

    cache, hf_cache = ours.new_cache(), DynamicCache(config=hf.config)
    assert isinstance(cache, SlidingCompressedCache)
    with torch.no_grad():
        same(ours(ids[:, :9], cache=cache).logits, hf(ids[:, :9], past_key_values=hf_cache, use_cache=True).logits,
             "prefill logits")
        for t in range(9, 11):  # one step closes a CSA window, the next an HCA window
            same(ours(ids[:, t:t + 1], cache=cache).logits,
                 hf(ids[:, t:t + 1], past_key_values=hf_cache, use_cache=True).logits, f"decode step {t}")
    w = ours.config.sliding_window
    assert cache.keys[0].shape[2] == w - 1  # only the window is kept
    assert cache.states[1]["compressor"].entries.shape[1] == 11 // 2 and cache.states[2]["compressor"].count == 2
    assert cache.states[0] is None and cache.states[2]["compressor"].buffer_kv.shape[1] == 11 % 4


def test_mtp_and_unknown_tensors_kept_and_written_back_byte_identical(ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpt(), src)
    weights = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    mtp = {"mtp.0.attn.wq_a.weight": torch.randn(24, 32, generator=g).bfloat16(),
           "mtp.0.e_proj.weight": torch.randn(32, 32, generator=g).to(torch.float8_e4m3fn),
           "mtp.0.e_proj.scale": torch.rand(1, 1, generator=g),
           "mtp.0.hc_head_fn": torch.randn(3, 96, generator=g)}
    save_file({**weights, **mtp}, str(src / "model.safetensors"), metadata={"format": "pt"})
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert sorted(ours.mtp_tensors) == sorted(mtp) and ours.load_report.ignored == []
    ours.save_pretrained(tmp_path / "out")
    check = compare_weights(tmp_path / "out", src)  # every tensor: same name, dtype and bytes
    assert check.ok, check.detail
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # transformers skips mtp.* by design
    with torch.no_grad():
        same(ours(**batches()[2]).logits, hf.eval()(**batches()[2]).logits, "logits beside MTP tensors")


def test_deepseek_layout_without_model_prefix_loads_like_transformers(ckpt, tmp_path):
    """DeepSeek's own checkpoints: no `model.` prefix, `embed`, `hc_head_fn`, `head`. Both libraries read them."""
    shutil.copytree(ckpt(), tmp_path / "own")
    weights = load_file(str(tmp_path / "own" / "model.safetensors"))
    renamed = {}
    for k, v in weights.items():
        k = k.removeprefix("model.").replace("embed_tokens.", "embed.")
        renamed[k.replace("hc_head.hc_", "hc_head_")] = v
    assert "hc_head_fn" in renamed and "embed.weight" in renamed and "head.weight" in renamed
    save_file(renamed, str(tmp_path / "own" / "model.safetensors"), metadata={"format": "pt"})
    ours, hf = _pair(tmp_path / "own")
    assert ours.load_report.ignored == []
    with torch.no_grad():
        same(ours(**batches()[2]).logits, hf(**batches()[2]).logits, "logits from DeepSeek's layout")


def test_lora_on_attention_and_shared_expert_loads_in_peft_with_identical_logits(ckpt, tmp_path):
    import peft

    from kiln.models.common.lora import LoraConfig, apply_lora, save_adapter

    src = ckpt()
    ours = AutoModelForCausalLM.from_pretrained(src)
    chosen = apply_lora(ours, LoraConfig(r=4, alpha=8, targets=["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj",
                                                                "gate_proj", "up_proj", "down_proj"]))
    assert "model.layers.0.self_attn.q_a_proj" in chosen and "model.layers.2.mlp.shared_experts.down_proj" in chosen
    assert not any("o_a_proj" in n or "experts.gate_up" in n for n in chosen)  # grouped / stacked: not Linears
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        ours(**batches()[1]).loss.backward()
        opt.step()
        opt.zero_grad()
    save_adapter(ours.eval(), tmp_path / "adapter", base_model_name_or_path=str(src))
    base = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        untuned = base(**batches()[2]).logits
    hf = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        tuned = ours(**batches()[2]).logits
        same(tuned, hf(**batches()[2]).logits, "LoRA logits")
    assert not torch.equal(tuned, untuned)


def test_hash_layer_needs_token_ids(ckpt):
    ours = AutoModelForCausalLM.from_pretrained(ckpt())
    embeds = ours.model.embed_tokens(batches()[0]["input_ids"])
    with pytest.raises(KilnError, match="hash-routed MoE layer picks experts by token id"):
        ours(inputs_embeds=embeds)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 2}, r"num_key_value_heads must be 1 for deepseek_v4"),
    ({"layer_types": ["sliding_attention"]}, r"layer_types must list 3 entries"),
    ({"mlp_layer_types": ["moe", "dense", "moe"]}, r"mlp_layer_types must list 3 entries"),
    ({"o_groups": 3}, r"o_groups \(3\) must divide num_attention_heads \* head_dim \(64\)"),
    ({"scoring_func": "softmax"}, r"scoring_func 'softmax' is not supported"),
    ({"index_head_dim": 4}, r"at most head_dim \(16\) and index_head_dim \(4\)"),
])
def test_config_errors_are_named(change, message, tiny_factory, tmp_path):
    shutil.copytree(tiny_factory("deepseek_v4", "causal-lm"), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path / "d")


def test_default_schedules_derived_like_transformers():
    from kiln.models.deepseek_v4 import DeepseekV4Config

    for extra in ({}, {"num_hash_layers": 1}, {"compress_ratios": [0, 4, 128, 4, 0, 128]}):
        ours = DeepseekV4Config.from_dict({"num_hidden_layers": 6, **extra})
        theirs = transformers.DeepseekV4Config(num_hidden_layers=6, **extra)
        assert ours.attention_kinds() == theirs.layer_types and ours.mlp_kinds() == theirs.mlp_layer_types, extra
        assert ours.rope_dim == theirs.qk_rope_head_dim
