"""`kiln export` / `kiln verify-export` on block-scaled FP8 directories: written back FP8 byte for byte,
or as plain bf16 on request; transformers' side dequantizes (its loader where it reads the blocks,
its own block-true dequantization where the shapes leave partial blocks)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.models.fp8_cases import make_fp8


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


@pytest.mark.parametrize("block,loader", [((16, 16), "_dequantize_fp8_weight"), ((128, 128), "its FP8 loader")])
def test_export_and_verify_fp8(tiny_factory, tmp_path, block, loader):
    src = make_fp8(tiny_factory("deepseek_v3", "causal-lm"), tmp_path / "fp8", "DeepseekV3ForCausalLM", block=block,
                   scale_fmt="ue8m0")
    r = _run("export", src, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    r = _run("verify-export", tmp_path / "out", "--source", src)
    assert r.exit_code == 0, r.output
    assert f"FP8 dequantized by {loader}" in r.output.replace("finegrained_fp8.", "") and "names/dtypes/bytes identical" in r.output
    assert "FAIL" not in r.output

    if block == (16, 16):  # on request: plain bf16, quantization_config dropped, an ordinary checkpoint
        r = _run("export", src, "--out", tmp_path / "bf16", "--dtype", "bf16")
        assert r.exit_code == 0, r.output
        cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
        weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
        assert "quantization_config" not in cfg and not any(k.endswith("_scale_inv") for k in weights)
        # every weight bf16 (the router's correction bias stays float32, as transformers keeps it)
        assert {v.dtype for k, v in weights.items() if k.endswith(".weight")} == {torch.bfloat16}
        r = _run("verify-export", tmp_path / "bf16")
        assert r.exit_code == 0 and "FAIL" not in r.output, r.output
        r = _run("export", src, "--out", tmp_path / "x", "--dtype", "fp4")
        assert r.exit_code == 1 and "--dtype 'fp4': choose one of bf16, fp16, fp32" in r.output


@pytest.mark.parametrize("model_type,arch", [("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
                                             ("deepseek_v4", "DeepseekV4ForCausalLM")])
def test_export_and_verify_fp8_release_families(tiny_factory, tmp_path, model_type, arch):
    """Qwen3.5/3.6-MoE (vision tower and all under one top-level quantization_config) and DeepSeek-V4 in
    transformers' layout: written back FP8 byte for byte, and transformers computes the same logits."""
    src = make_fp8(tiny_factory(model_type, "causal-lm"), tmp_path / "fp8", arch, block=(16, 16), scale_fmt="ue8m0")
    r = _run("export", src, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    r = _run("verify-export", tmp_path / "out", "--source", src)
    assert r.exit_code == 0 and "FAIL" not in r.output, r.output
    assert "names/dtypes/bytes identical" in r.output
    if model_type == "qwen3_5_moe":  # the image batch reaches transformers' image-text class with its pixels
        assert "loads Qwen3_5MoeForConditionalGeneration" in r.output and "PASS  batch 2 logits" in r.output
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" in cfg and "quantization_config" not in cfg.get("text_config", {})
