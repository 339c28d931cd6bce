"""LoRA on an FP8 base: the base stays FP8 and frozen, adapters train; PEFT on transformers' dequantized
model gives the same logits; merging re-quantizes the changed weights in their blocks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.hub.fp8 import dequantize, quantize
from kiln.models.auto import load_pretrained
from kiln.models.common.fp8 import FP8Linear, dequantize_model
from kiln.models.common.lora import LoraConfig, LoraLinear, apply_lora, merge_lora, save_adapter
from tests.models.causal_cases import same
from tests.models.fp8_cases import make_fp8, transformers_dequantized

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def dirs(tiny_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-lora")
    fp8 = make_fp8(tiny_factory("qwen3", "causal-lm"), root / "fp8", "Qwen3ForCausalLM", scale_fmt="ue8m0")
    return fp8, transformers_dequantized(fp8, root / "plain")


def _lora(model):
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=TARGETS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _ids():
    return torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(2))


def test_adapters_train_on_a_frozen_fp8_base_and_match_peft(dirs, tmp_path):
    import transformers
    from peft import PeftModel

    fp8_dir, plain_dir = dirs
    model = _lora(load_pretrained(fp8_dir, fp8="keep"))
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
    assert layer.lora_A.weight.dtype == torch.float32
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)

    save_adapter(model, tmp_path / "adapter")
    transformers.logging.set_verbosity_error()
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(plain_dir))
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        same(model.eval()(input_ids=_ids()).logits, peft(input_ids=_ids()).logits, "kiln fp8 base + LoRA vs PEFT")

    # one backward: adapter gradients equal those over the dequantized base, no gradient for the FP8 weights
    ref = _lora(load_pretrained(fp8_dir))
    for m in (model, ref):
        m.train()
        m(input_ids=_ids(), labels=_ids()).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-6, atol=1e-7, msg=n)
    assert layer.weight.grad is None


def test_merge_requantizes_and_base_memory_is_half_of_bf16(dirs, tmp_path):
    fp8_dir, _ = dirs
    model = _lora(load_pretrained(fp8_dir, fp8="keep"))
    deltas = {n: m.delta_weight() for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    merge_lora(model)
    assert isinstance(model.model.layers[1].mlp.down_proj, FP8Linear)
    model.save_pretrained(tmp_path / "merged")
    got, src = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(fp8_dir / "model.safetensors"))
    for n, delta in deltas.items():
        hf = n + ".weight"
        q, s = quantize(dequantize(src[hf], src[hf + "_scale_inv"], (16, 16)) + delta, (16, 16), ue8m0=True)
        assert torch.equal(got[hf].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[hf + "_scale_inv"], s)
    untouched = [k for k in src if not any(k.startswith(n + ".") for n in deltas)]
    assert all(torch.equal(got[k].view(torch.uint8), src[k].view(torch.uint8)) for k in untouched)

    # or merged in bf16, with no quantization left
    bf16 = dequantize_model(_lora(load_pretrained(fp8_dir, fp8="keep")), torch.bfloat16)
    merge_lora(bf16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16} and "quantization_config" not in bf16.config.extra

    def base_bytes(m):  # the frozen Linear weights of the blocks, with their scales
        return sum(t.numel() * t.element_size() for n, t in m.state_dict().items()
                   if ".layers." in n and ("proj.weight" in n or n.endswith("_scale_inv")))
    kept = load_pretrained(fp8_dir, fp8="keep", dtype=torch.bfloat16)  # a dtype cast leaves FP8 weights as stored
    assert kept.model.layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn
    assert kept.model.layers[0].mlp.up_proj.weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert kept.model.norm.weight.dtype == torch.bfloat16
    fp8_base, bf16_base = base_bytes(kept), base_bytes(load_pretrained(fp8_dir, dtype=torch.bfloat16))
    assert 0.5 <= fp8_base / bf16_base < 0.52, (fp8_base, bf16_base)
