"""Block-scaled FP8 checkpoints through kiln: load (dequantized or kept FP8), logits, export, per family.

The reference is transformers: its finegrained_fp8 dequantization of every weight, and the model it
builds from those weights (and, where its loader accepts the shapes, its own FP8 loader).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.interop.verify import compare_weights
from kiln.models.auto import REGISTRY, load_pretrained
from kiln.models.common.fp8 import Fp8Experts, FP8Linear, dequantize_model
from tests.models.causal_cases import same
from tests.models.fp8_cases import make_fp8, transformers_dequantized

# family, head, scale format; block (16, 16) against hidden 32 / intermediate 37 / experts 16 leaves
# partial blocks in most weights
CASES = [("bert", "masked-lm", "ue8m0"), ("qwen3", "causal-lm", "float"), ("qwen3_moe", "causal-lm", "ue8m0"),
         ("deepseek_v3", "causal-lm", "float"), ("glm_moe_dsa", "causal-lm", "ue8m0"),
         ("deepseek_v4", "causal-lm", "ue8m0"), ("qwen3_5_moe", "causal-lm", "float")]


@pytest.fixture(scope="module")
def fp8_dirs(tiny_factory, tmp_path_factory):
    """(model_type, task, fmt, block) -> (FP8 directory, its transformers-dequantized float32 twin)."""
    cache = {}

    def make(model_type: str, task: str, fmt: str, block=(16, 16)):
        key = (model_type, task, fmt, block)
        if key not in cache:
            arch = REGISTRY[model_type].tasks[task].architecture
            root = tmp_path_factory.mktemp(f"fp8-{model_type}-{fmt}")
            fp8 = make_fp8(tiny_factory(model_type, task), root / "fp8", arch, block=block, scale_fmt=fmt)
            cache[key] = fp8, transformers_dequantized(fp8, root / "plain")
        return cache[key]

    return make


def _inputs(model_type: str) -> dict:
    ids = torch.randint(5, 99, (2, 11), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": attn}


def _hf_model(arch: str, path: Path, **kw):
    import transformers

    transformers.logging.set_verbosity_error()
    return getattr(transformers, arch).from_pretrained(str(path), **kw).eval()


@pytest.mark.parametrize("model_type,task,fmt", CASES)
def test_dequantized_weights_logits_and_export(fp8_dirs, tmp_path, model_type, task, fmt):
    fp8_dir, plain_dir = fp8_dirs(model_type, task, fmt)
    reference = load_file(str(plain_dir / "model.safetensors"))
    on_disk = load_file(str(fp8_dir / "model.safetensors"))
    assert any(v.dtype == torch.float8_e4m3fn for v in on_disk.values())
    hf = _hf_model(REGISTRY[model_type].tasks[task].architecture, plain_dir)
    with torch.no_grad():
        want = hf(**_inputs(model_type)).logits
    for mode in ("dequantize", "keep"):
        model = load_pretrained(fp8_dir, fp8=mode)
        if mode == "dequantize":  # every weight equals transformers' dequantization, bit for bit
            weights, unmatched = model.family.keymap(model.task).to_hf(model.state_dict())
            assert not unmatched
            for k, v in weights.items():
                same(v, reference[k], k)
        else:  # the FP8 weights stay FP8 in memory: one byte each
            fp8_params = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
            assert fp8_params and any(isinstance(m, FP8Linear) for m in model.modules())
            if model_type in ("qwen3_moe", "deepseek_v3", "glm_moe_dsa"):
                assert any(isinstance(m, Fp8Experts) for m in model.modules())
        with torch.no_grad():
            same(model(**_inputs(model_type)).logits, want, f"{model_type} {mode} logits")
        out = tmp_path / mode
        model.save_pretrained(out)
        check = compare_weights(out, fp8_dir)  # untouched: FP8 weights and scales byte for byte
        assert check.ok, check.detail
        cfg_out, cfg_in = (json.loads((d / "config.json").read_text()) for d in (out, fp8_dir))
        assert cfg_out["quantization_config"] == cfg_in["quantization_config"]


def test_transformers_own_fp8_loader_agrees(fp8_dirs, tmp_path):
    """128x128 blocks over tiny weights (one partial block each): transformers' FP8 loader (dequantizing
    on CPU) accepts the directory, and kiln's logits equal its model's."""
    fp8_dir, _ = fp8_dirs("qwen3_moe", "causal-lm", "float", (128, 128))
    hf = _hf_model("Qwen3MoeForCausalLM", fp8_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(**_inputs("qwen3_moe")).logits
        for mode in ("dequantize", "keep"):
            same(load_pretrained(fp8_dir, fp8=mode)(**_inputs("qwen3_moe")).logits, want, mode)


def test_changed_weight_is_requantized_and_bf16_export(fp8_dirs, tmp_path):
    from kiln.hub.fp8 import dequantize, quantize

    fp8_dir, _ = fp8_dirs("qwen3", "causal-lm", "float")
    model = load_pretrained(fp8_dir)
    name = "model.layers.1.mlp.up_proj.weight"
    bump = torch.rand(37, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(bump)
    model.save_pretrained(tmp_path / "changed")
    got, src = load_file(str(tmp_path / "changed" / "model.safetensors")), load_file(str(fp8_dir / "model.safetensors"))
    q, s = quantize(dequantize(src[name], src[name + "_scale_inv"], (16, 16)) + bump, (16, 16))
    assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[name + "_scale_inv"], s)
    changed = [k for k in src if not torch.equal(src[k].view(torch.uint8), got[k].view(torch.uint8))]
    assert sorted(changed) == [name, name + "_scale_inv"]

    # on request: plain bf16 weights, no quantization_config, loadable as an ordinary checkpoint
    plain = dequantize_model(load_pretrained(fp8_dir, fp8="keep"), torch.bfloat16)
    plain.save_pretrained(tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert "quantization_config" not in cfg and not any(k.endswith("_scale_inv") for k in weights)
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    same(weights[name], dequantize(src[name], src[name + "_scale_inv"], (16, 16), torch.bfloat16), name)
