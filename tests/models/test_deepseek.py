"""DeepSeek-V3, DeepSeek-V3.2 and GLM-5: bit-identical to transformers (fp32, CPU) in logits, loss, router
logits and gradients, both load directions (tests/models/test_parity.py); cached greedy and sampled generation; MTP tensors kept byte for
byte; LoRA on the MLA projections loads in PEFT; config errors named."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from kiln.errors import ConfigError
from kiln.interop.export import export_model
from kiln.interop.verify import compare_weights
from kiln.models import AutoModelForCausalLM
from kiln.models.common.mla import MLACache
from kiln.models.common.moe_routing import SharedExpertMoE
from tests.models.causal_cases import batches, model_pair, same
from tests.models.rounding import assert_within, rounding_error

FAMILIES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]
transformers.logging.set_verbosity_error()


@pytest.fixture
def ckpt(tiny_factory):
    """make(model_type, task="causal-lm", **overrides): the tiny checkpoint, its balancing biases random too (not
    zero: the families' Tiny.randomize), so a bias dropped or added in the wrong place changes the experts."""
    return lambda model_type, task="causal-lm", **overrides: tiny_factory(model_type, task, **overrides)


_pair = model_pair


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tiny_checkpoint_biases_are_random_and_parameter_names_are_transformers(model_type, ckpt):
    """What the parity harness (tests/models/test_parity.py) compares: random balancing biases, parameters under
    the same in-memory names as transformers' (stacked experts alike), expert load counted in training mode."""
    ours, hf = _pair(ckpt(model_type))
    bias = ours.model.layers[1].mlp.gate.e_score_correction_bias
    assert bool(bias.abs().sum() > 0)
    assert set(dict(ours.named_parameters())) == set(dict(hf.named_parameters()))
    ours.train()
    batch = batches()[2]
    ours(**batch).loss.backward()
    loads = [m.gate.expert_load for m in ours.modules() if isinstance(m, SharedExpertMoE)]
    assert loads and int(loads[0].sum()) == batch["input_ids"].numel() * ours.config.num_experts_per_tok
    indexer = [p for n, p in ours.named_parameters() if ".indexer." in n]
    assert all(p.grad is None for p in indexer)  # the indexer picks keys: no gradient (in transformers neither)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_latent_cache_holds_the_latent(model_type, ckpt):
    """The cache holds the latent, not per-head keys and values (its steps equal transformers': test_parity)."""
    ours = AutoModelForCausalLM.from_pretrained(ckpt(model_type))
    ids = torch.randint(4, 99, (1, 7), generator=torch.Generator().manual_seed(5))
    cache = ours.new_cache()
    assert isinstance(cache, MLACache)
    with torch.no_grad():
        ours(ids[:, :6], cache=cache)
        ours(ids[:, 6:], cache=cache)
    c = ours.config
    assert cache.keys[0].shape == (1, 1, 7, c.kv_lora_rank) and cache.values[0].shape == (1, 1, 7, c.qk_rope_head_dim)


def _cached_greedy(model, ids, attn, n):
    """Greedy through the model's own decoding cache (prefill, then a token a row a step): the path under test
    (model.generate runs on the generation engine, which reads the weights itself: engfsdp)."""
    cache, mask = model.new_cache(), attn
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out, step = ids, ids
    with torch.no_grad():
        for _ in range(n):
            logits = model(step, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1).logits
            token = logits[:, -1].float().argmax(-1)
            out, mask = torch.cat([out, token[:, None]], 1), F.pad(mask, (0, 1), value=1)
            step, positions = token[:, None], positions[:, -1:] + 1
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_absorbed_decode_fast_path_within_rounding_and_skips_kv_expansion(model_type, ckpt):
    from kiln.models.common.fast import set_fast

    ours, _ = _pair(ckpt(model_type), eos=False)
    ids = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(6))
    attn = torch.ones_like(ids)
    attn[1, :2] = 0
    exact = _cached_greedy(ours, ids, attn, 12)
    expansions = []
    hook = ours.model.layers[0].self_attn.kv_b_proj.register_forward_hook(lambda *a: expansions.append(1))
    fast = _cached_greedy(set_fast(ours), ids, attn, 12)
    hook.remove()
    assert torch.equal(fast, exact) and len(expansions) == 1  # only the prefill expanded the latent
    caches = ours.new_cache(), ours.new_cache()
    step = {"input_ids": ids[:, -1:], "attention_mask": F.pad(attn, (0, 1), value=1),
            "position_ids": attn.sum(-1, keepdim=True)}
    with torch.no_grad():
        ours(ids, attention_mask=attn, cache=caches[0])
        ours(ids, attention_mask=attn, cache=caches[1])
        a = ours(**step, cache=caches[0]).logits
        b = set_fast(ours, False)(**step, cache=caches[1]).logits
        ours64, cache64 = copy.deepcopy(ours).double(), ours.new_cache()  # the exact path's rounding, measured
        ours64(ids, attention_mask=attn, cache=cache64)
        b64 = ours64(**step, cache=cache64).logits
    assert not torch.equal(a, b)  # another summation order ...
    e = rounding_error(b, b64, ours.config.intermediate_size)  # the longest sum behind a logit
    assert_within(a, b, e, f"{model_type} absorbed decode logits")  # ... of the same maths


# engfsdp: sampled generation against transformers' draws (torch.multinomial from the global generator) tested
# kiln's earlier loop, which drew the same way; generate runs on the engine now, whose requests draw from their own
# generators (kiln.engine.sampling, tested against direct implementations in tests/engine/test_sampling.py).


def test_sparse_attention_changes_outputs_and_v3_options(ckpt):
    """The indexer really narrows attention at these lengths; V3 with a query latent and half-split rope matches too."""
    batch = batches()[1]
    with torch.no_grad():
        narrow = AutoModelForCausalLM.from_pretrained(ckpt("deepseek_v32"))(**batch).logits
        wide = AutoModelForCausalLM.from_pretrained(ckpt("deepseek_v32", index_topk=64))(**batch).logits
    assert not torch.equal(narrow, wide)
    ours, hf = _pair(ckpt("deepseek_v3", q_lora_rank=24, rope_interleave=False))
    assert hasattr(ours.model.layers[0].self_attn, "q_a_proj")
    with torch.no_grad():
        same(ours(**batch).logits, hf(**batch).logits, "v3 with q_lora_rank, rope_interleave=False")


def test_experts_on_disk_one_tensor_each_and_bias_kept(ckpt, tmp_path):
    from safetensors import safe_open

    src = ckpt("deepseek_v3")
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert ours.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 32, 32)  # (E, 2I, C)
    out = export_model(ours, tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")} <= keys
    assert not any("gate_up_proj" in k for k in keys)
    assert bias.dtype == torch.float32 and bool(bias.abs().sum() > 0)
    # under bf16 the bias stays float32, as transformers keeps it
    half = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert half.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert half.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16


def _add_mtp_layer(src, dst):
    """A copy of `src` with a multi-token-prediction layer `model.layers.{n}`, as DeepSeek ships it: a full
    decoder layer plus enorm/hnorm/eh_proj/shared_head, some tensors bf16 and one FP8 with its scale."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(str(dst / "model.safetensors"))
    n = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(9)
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): torch.randn(v.shape, generator=g)
           for k, v in weights.items() if k.startswith(f"model.layers.{n - 1}.")}
    C, V = weights["model.norm.weight"].shape[0], weights["lm_head.weight"].shape[0]
    mtp.update({f"model.layers.{n}.enorm.weight": torch.randn(C, generator=g).bfloat16(),
                f"model.layers.{n}.hnorm.weight": torch.randn(C, generator=g).bfloat16(),
                f"model.layers.{n}.eh_proj.weight": torch.randn(C, 2 * C, generator=g).to(torch.float8_e4m3fn),
                f"model.layers.{n}.eh_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
                f"model.layers.{n}.shared_head.norm.weight": torch.randn(C, generator=g),
                f"model.layers.{n}.shared_head.head.weight": torch.randn(V, C, generator=g).bfloat16(),
                f"model.layers.{n}.embed_tokens.weight": torch.randn(V, C, generator=g)})
    save_file({**weights, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return sorted(mtp)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_mtp_layers_kept_and_written_back_byte_identical(model_type, ckpt, tmp_path):
    src = tmp_path / "src"
    mtp = _add_mtp_layer(ckpt(model_type), src)
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert sorted("model." + k for k in ours.hf_extras) == mtp and ours.load_report.ignored == []
    ours.save_pretrained(tmp_path / "out")
    check = compare_weights(tmp_path / "out", src)  # every tensor: same name, dtype and bytes
    assert check.ok, check.detail
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    n = ours.config.num_hidden_layers  # transformers ignores them (naming its experts stacked)
    assert not info["missing_keys"] and info["unexpected_keys"]
    assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    with torch.no_grad():
        same(ours(**batches()[2]).logits, hf.eval()(**batches()[2]).logits, "logits beside MTP tensors")
    from kiln.interop.verify import verify_export

    checks = verify_export(tmp_path / "out", src)  # the MTP layer is not a missing/unexpected-keys failure
    assert all(c.ok for c in checks), [(c.name, c.detail) for c in checks if not c.ok]
    assert "multi-token-prediction tensors past the last layer kept" in checks[0].detail


def _train_lora(model, targets):
    from kiln.models.common.lora import LoraConfig, apply_lora

    chosen = apply_lora(model, LoraConfig(r=4, alpha=8, targets=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        model(**batches()[1]).loss.backward()
        opt.step()
        opt.zero_grad()
    return chosen


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
def test_lora_on_mla_projections_loads_in_peft_with_identical_logits(model_type, ckpt, tmp_path):
    import peft

    from kiln.models.common.lora import save_adapter

    src = ckpt(model_type)
    ours = AutoModelForCausalLM.from_pretrained(src)
    q = ["q_proj"] if ours.config.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    chosen = _train_lora(ours, q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    assert len(chosen) == 2 * (len(q) + 3)
    save_adapter(ours.eval(), tmp_path / "adapter", base_model_name_or_path=str(src))
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src),
                                        tmp_path / "adapter").eval()
    with torch.no_grad():
        same(ours(**batches()[2]).logits, hf(**batches()[2]).logits, "LoRA logits")


def test_lora_on_dense_and_shared_expert_mlps_trains_reloads_and_merges(ckpt, tmp_path):
    """PEFT 0.21 re-targets gate/up/down_proj of these model types to the routed experts (its v4 -> v5 adapter
    conversion), so for the MLPs the check is kiln's own reload and the merged export loaded by transformers."""
    src = ckpt("deepseek_v32")
    ours = AutoModelForCausalLM.from_pretrained(src)
    chosen = _train_lora(ours, ["gate_proj", "up_proj", "down_proj"])
    assert sorted(chosen) == sorted(f"model.layers.{i}.mlp.{part}{p}" for i, part in ((0, ""), (1, "shared_experts."))
                                    for p in ("gate_proj", "up_proj", "down_proj"))
    ours.eval()
    with torch.no_grad():
        tuned = ours(**batches()[2]).logits
        base = AutoModelForCausalLM.from_pretrained(src)(**batches()[2]).logits
    assert not torch.equal(tuned, base)
    ours.save_pretrained(tmp_path / "ckpt")  # base + adapter beside it
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    merged = transformers.AutoModelForCausalLM.from_pretrained(export_model(ours, tmp_path / "merged")).eval()
    with torch.no_grad():
        same(again(**batches()[2]).logits, tuned, "reloaded LoRA logits")
        torch.testing.assert_close(merged(**batches()[2]).logits, tuned, rtol=1e-5, atol=1e-5)


def test_adapter_names_a_module_whose_leaf_name_is_shared_by_unadapted_ones(ckpt, tmp_path):
    """Only the shared experts' gate_proj adapted: the dense layer's mlp.gate_proj is not, so the adapter
    config says `shared_experts.gate_proj` (PEFT matches a name or a '.'-suffix of it) and kiln's reload
    adapts exactly that module. (PEFT itself cannot load it on this model type: its v4 -> v5 conversion
    re-targets gate_proj to the routed experts, see the test above.)"""
    import json

    from kiln.models.common.lora import load_adapter, save_adapter

    src = ckpt("deepseek_v3")
    ours = AutoModelForCausalLM.from_pretrained(src)
    assert _train_lora(ours, ["shared_experts.gate_proj", "o_proj"]) == [
        "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.shared_experts.gate_proj"]
    save_adapter(ours.eval(), tmp_path / "adapter", base_model_name_or_path=str(src))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["o_proj", "shared_experts.gate_proj"]
    again = load_adapter(AutoModelForCausalLM.from_pretrained(src), tmp_path / "adapter").eval()
    assert sorted(again.lora_targets) == sorted(ours.lora_targets)
    with torch.no_grad():
        same(again(**batches()[2]).logits, ours(**batches()[2]).logits, "kiln reload")


@pytest.mark.parametrize("model_type, change, message", [
    ("deepseek_v3", {"n_group": 3}, r"n_routed_experts \(8\) must split into n_group \(3\)"),
    ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    ("deepseek_v3", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be within 1..4"),
    ("deepseek_v32", {"q_lora_rank": None}, r"q_lora_rank is required for deepseek_v32"),
    ("deepseek_v32", {"mlp_layer_types": ["dense"]}, r"mlp_layer_types must list 2 entries"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full"]}, r"indexer_types must list 2 entries .* the first 'full'"),
])
def test_config_errors_are_named(model_type, change, message, tiny_factory, tmp_path):
    shutil.copytree(tiny_factory(model_type, "causal-lm"), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path / "d")


def test_glm_indexer_schedule_derived_like_transformers():
    from kiln.models.glm_moe_dsa import GlmMoeDsaConfig

    for extra in ({}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}, {"index_topk_pattern": "FSSF"}):
        ours = GlmMoeDsaConfig.from_dict({"num_hidden_layers": 4, **extra})
        theirs = transformers.GlmMoeDsaConfig(num_hidden_layers=4, **extra)
        assert ours.indexer_kinds() == theirs.indexer_types, extra
