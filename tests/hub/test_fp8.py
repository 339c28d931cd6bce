"""kiln.hub.fp8: the block scheme, quantize / dequantize against transformers, and bad input by message."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError, KilnError, WeightsError
from kiln.hub import fp8
from tests.models.fp8_cases import quantize_reference

E8M0 = torch.float8_e8m0fnu


def _w(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # blocks of very different ranges
    w[..., :3, :5] = 0.0  # an all-zero corner block where the block is small
    return w


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape,block", [((37, 50), (16, 16)), ((96, 40), (32, 16)), ((200, 300), (128, 128))])
def test_quantize_follows_the_formula(shape, block, ue8m0):
    w = _w(*shape)
    q, s = fp8.quantize(w, block, ue8m0)
    rq, rs = quantize_reference(w, block, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == (E8M0 if ue8m0 else torch.float32)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.float(), rs.float())
    err = (fp8.dequantize(q, s, block) - w).abs()
    per_element_scale = fp8.dequantize(torch.ones_like(q), s, block)
    # round to nearest: half an ulp of e4m3's 3 mantissa bits, or half its smallest subnormal step (2**-9)
    assert (err <= w.abs() * 2**-4 + per_element_scale * 2**-10).all()


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_quantize_equals_transformers_where_it_quantizes(fmt):
    """transformers' Fp8Quantize tiles only shapes that divide by the block: there kiln's bytes equal its."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[16, 32], scale_fmt=fmt))
    w = _w(3, 48, 64)  # stacked experts: one scale grid each
    theirs = Fp8Quantize(quantizer)._quantize_one("m.weight", w)
    q, s = fp8.quantize(w, (16, 32), fmt == "ue8m0")
    assert torch.equal(q.view(torch.uint8), theirs["m.weight"].view(torch.uint8))
    assert s.dtype == theirs["m.weight_scale_inv"].dtype and torch.equal(s.float(), theirs["m.weight_scale_inv"].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    w = _w(2, 37, 50)
    q, s = fp8.quantize(w, (16, 16))
    ours = fp8.dequantize(q, s, (16, 16), dtype)
    if dtype == torch.float32:  # the block-true dequantization (partial last blocks)
        assert torch.equal(ours, _dequantize_fp8_weight(q, s, [16, 16], dtype))
    q, s = fp8.quantize(_w(2, 48, 64), (16, 16))  # the loader's Fp8Dequantize: fp32 product, one rounding
    theirs = Fp8Dequantize(SimpleNamespace())._dequantize_one(q, s, output_dtype=dtype)
    assert torch.equal(fp8.dequantize(q, s, (16, 16), dtype), theirs)


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0, torch.uint8])
def test_a_box_at_its_origin_dequantizes_as_the_whole(scale_dtype):
    """A box (rows 5:29, columns 19:50: mid-block edges, the partial last blocks) with the whole scale blocks
    around it, at its origin, equals that box of the whole weight's dequantization bit for bit."""
    q, s = fp8.quantize(_w(2, 37, 50), (16, 16), ue8m0=scale_dtype != torch.float32, scale_dtype=scale_dtype)
    whole = fp8.dequantize(q, s, (16, 16), torch.bfloat16)
    box = fp8.dequantize(q[:, 5:29, 19:50], s[:, 0:2, 1:4], (16, 16), torch.bfloat16, origin=(5, 19))
    assert torch.equal(box, whole[:, 5:29, 19:50])
    assert not torch.equal(fp8.dequantize(q[:, 5:29, 19:50], s[:, 0:2, 1:4], (16, 16), torch.bfloat16), box)
    with pytest.raises(ValueError, match=r"origin \(-1, 0\)"):
        fp8.dequantize(q, s, (16, 16), origin=(-1, 0))


def test_transformers_loader_takes_the_block_from_the_scale_grid():
    """Why kiln does not take the block size from the grid: with partial blocks the grid can divide
    the weight evenly and still not be its blocks (30 rows in blocks of 16 -> 2 blocks, not 15 rows each)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = _w(30, 16)
    q, s = fp8.quantize(w, (16, 16))
    theirs = Fp8Dequantize(SimpleNamespace())._dequantize_one(q, s, output_dtype=torch.float32)
    assert not torch.equal(theirs, fp8.dequantize(q, s, (16, 16)))
    assert (fp8.dequantize(q, s, (16, 16)) - w).abs().max() < (theirs - w).abs().max()


def test_ue8m0_bytes_and_requantize_roundtrip():
    w = _w(40, 24)
    q, s = fp8.quantize(w, (16, 16), ue8m0=True)
    _, raw = fp8.quantize(w, (16, 16), ue8m0=True, scale_dtype=torch.uint8)  # MXFP8: exponent bytes
    assert torch.equal(fp8.dequantize(q, raw, (16, 16)), fp8.dequantize(q, s, (16, 16)))
    scheme = fp8.Fp8Scheme(block=(16, 16), scale_fmt="ue8m0")
    state, pairs = fp8.dequantize_state({"a.weight": q, "a.weight_scale_inv": s, "b": w}, scheme, torch.float32)
    assert set(state) == {"a.weight", "b"}
    back = fp8.requantize_state(state, scheme, pairs)
    assert back["a.weight"] is q and back["a.weight_scale_inv"] is s


def test_scheme_from_config_and_its_errors():
    scheme = fp8.scheme_from_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"]}})
    assert scheme.block == (128, 128) and not scheme.ue8m0
    assert scheme.skips("lm_head.weight") and scheme.skips("model.layers.3.mlp.gate.weight")
    assert not scheme.skips("model.layers.3.mlp.gate_proj.weight")
    assert fp8.scheme_from_config({}) is None
    bad = [({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
           ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
           ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
           ({"quant_method": "fp8", "scale_fmt": "e4m3"}, "scale_fmt 'e4m3' is not supported")]
    for q, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            fp8.scheme_from_config({"quantization_config": q}, "cfg.json")


def test_ue8m0_on_a_torch_without_e8m0(monkeypatch):
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    with pytest.raises(ConfigError, match=r"cfg.json: quantization_config: scale_fmt 'ue8m0' needs "
                                          r"torch.float8_e8m0fnu, which torch .* lacks"):
        fp8.scheme_from_config({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}, "cfg.json")


def test_bad_pairs_by_message():
    scheme = fp8.Fp8Scheme(block=(16, 16), modules_to_not_convert=("lm_head",))
    q, s = fp8.quantize(_w(40, 24), (16, 16))
    with pytest.raises(WeightsError, match=r"FP8 tensor 'a.weight' \(shape \(40, 24\)\) has no scale 'a.weight_scale_inv'"):
        fp8.fp8_pairs({"a.weight": q}, scheme, "dir")
    with pytest.raises(WeightsError, match=r"scale 'a.weight_scale_inv' has shape \(2, 2\), but weight 'a.weight' of "
                                           r"shape \(40, 24\) in blocks of \[16, 16\] needs \(3, 2\)"):
        fp8.fp8_pairs({"a.weight": q, "a.weight_scale_inv": s[:2]}, scheme, "dir")
    with pytest.raises(WeightsError, match="modules_to_not_convert lists its module"):
        fp8.fp8_pairs({"lm_head.weight": q, "lm_head.weight_scale_inv": s}, scheme, "dir")
    with pytest.raises(WeightsError, match="scale\\(s\\) without an FP8 \\(or FP4\\) weight: 'b.weight_scale_inv'"):
        fp8.fp8_pairs({"b.weight": _w(4, 4), "b.weight_scale_inv": s}, scheme, "dir")
    fp8.fp8_pairs({"a.weight": q, "a.weight_scale_inv": s}, scheme, "dir")  # control: finite scales pass
    for value, shown in ((float("nan"), "nan"), (float("inf"), "inf")):
        bad = s.clone()
        bad[2, 1] = value
        with pytest.raises(WeightsError, match=rf"dir: scale 'a.weight_scale_inv' holds 1 non-finite value\(s\) "
                                               rf"\(first at index \(2, 1\): {shown}\); weight 'a.weight' cannot"):
            fp8.fp8_pairs({"a.weight": q, "a.weight_scale_inv": bad}, scheme, "dir")
    e8 = torch.full((3, 2), 127, dtype=torch.uint8)
    e8[0, 1] = 255
    with pytest.raises(WeightsError, match=r"index \(0, 1\): 255 = NaN in E8M0"):
        fp8.fp8_pairs({"a.weight": q, "a.weight_scale_inv": e8}, scheme, "dir")


def test_bad_checkpoint_through_load_pretrained(tiny_factory, tmp_path):
    """A block size that does not fit the stored scales, and a missing scale, name the tensor and shapes."""
    from kiln.models.auto import load_pretrained
    from tests.models.fp8_cases import make_fp8

    src = make_fp8(tiny_factory("qwen3", "causal-lm"), tmp_path / "fp8", "Qwen3ForCausalLM")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 32]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"scale 'model.layers.0.mlp.down_proj.weight_scale_inv' has shape \(2, 3\), "
                                           r"but weight .* of shape \(32, 37\) in blocks of \[32, 32\] needs \(1, 2\)"):
        load_pretrained(src)
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    (src / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(state, str(src / "model.safetensors"))
    for mode in ("dequantize", "keep"):
        with pytest.raises(WeightsError, match="FP8 tensor 'model.layers.1.self_attn.o_proj.weight' .* has no scale"):
            load_pretrained(src, fp8=mode)
    with pytest.raises(KilnError, match="fp8 mode 'half' is not one of: dequantize, keep"):
        load_pretrained(src, fp8="half")
