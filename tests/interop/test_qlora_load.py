"""4-bit (bitsandbytes) bases in kiln: a transformers-saved 4-bit directory loads as is with transformers'
logits, exports byte for byte; `quantize` at load writes transformers' own bytes; `--dtype` and merged
exports dequantize; bad input is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError, WeightsError
from kiln.hub import bnb4
from kiln.interop.export import export_model
from kiln.models.auto import load_pretrained
from kiln.models.common.quant4 import Linear4, dequantized
from tests.interop.qlora_cases import bf16_source, logits, transformers_bnb4, transformers_model

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def dirs(tiny_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    src = bf16_source(tiny_factory, tmp)
    return {"src": src, "nf4": transformers_bnb4(src, tmp / "nf4"),
            "fp4": transformers_bnb4(src, tmp / "fp4", "fp4", double=False, compute=torch.float32)}


def _same_files(a, b):
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
        assert torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)), k


IDS = torch.tensor([[1, 5, 17, 33, 60, 2, 9, 44, 71], [3, 3, 80, 12, 7, 90, 41, 5, 28]])


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_bnb4_directory_loads_with_transformers_logits_and_exports_byte_for_byte(dirs, tmp_path, kind):
    model = load_pretrained(dirs[kind])
    linears = [m for m in model.modules() if isinstance(m, Linear4)]
    assert len(linears) == 2 * 7  # every projection of both layers, 4-bit in memory (lm_head stays bf16)
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    want = logits(transformers_model(dirs[kind]), IDS)
    got = logits(model, IDS)
    assert got.dtype == want.dtype and torch.equal(got, want), (got.float() - want.float()).abs().max()
    # the control: one absmax byte off changes the logits, so the equality above can fail
    absmax = model.model.layers[0].mlp.down_proj.weight_absmax
    absmax[0] = absmax[0] ^ 1 if absmax.dtype == torch.uint8 else absmax[0] * 1.5
    assert not torch.equal(logits(model, IDS), want)

    export_model(load_pretrained(dirs[kind]), tmp_path / "out")
    _same_files(dirs[kind], tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((dirs[kind] / "config.json").read_text())["quantization_config"]


def test_quantize_at_load_writes_transformers_bytes(dirs, tmp_path):
    model = load_pretrained(dirs["src"], quantize="nf4")
    assert sum(isinstance(m, Linear4) for m in model.modules()) == 14
    export_model(model, tmp_path / "q")
    _same_files(dirs["nf4"], tmp_path / "q")  # the same weights, quantized by transformers + bitsandbytes
    # and transformers reads kiln's directory with kiln's logits
    assert torch.equal(logits(transformers_model(tmp_path / "q"), IDS), logits(model, IDS))
    # kiln export --quantize writes the same directory
    export_model(dirs["src"], tmp_path / "q2", quantize="nf4")
    _same_files(dirs["nf4"], tmp_path / "q2")


def test_dtype_export_dequantizes(dirs, tmp_path):
    export_model(dirs["nf4"], tmp_path / "plain", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    weights = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert "quantization_config" not in cfg and {v.dtype for v in weights.values()} == {torch.bfloat16}
    q = load_pretrained(dirs["nf4"])
    down = q.model.layers[1].mlp.down_proj
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"], dequantized(down, torch.bfloat16))
    plain = load_pretrained(tmp_path / "plain")
    # the plain model computes what the 4-bit one does (compute dtype bf16 = the dequantized dtype)
    assert torch.equal(logits(plain, IDS), logits(q, IDS))


def test_bad_input_is_named(dirs, tmp_path):
    with pytest.raises(ConfigError, match="already 4-bit quantized"):
        load_pretrained(dirs["nf4"], quantize="nf4")
    with pytest.raises(ConfigError, match="already 4-bit quantized"):
        export_model(dirs["nf4"], tmp_path / "x", quantize="fp4")
    with pytest.raises(ConfigError, match="unknown 4-bit quant type 'int3'"):
        load_pretrained(dirs["src"], quantize="int3")
    broken = tmp_path / "broken"
    shutil.copytree(dirs["nf4"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    gone = "model.layers.1.self_attn.k_proj.weight.nested_absmax"
    del weights[gone]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=f"missing quant-state tensor\\(s\\) '{gone}'"):
        load_pretrained(broken)
    del weights["model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.up_proj\.weight\.quant_state\.bitsandbytes__nf4"):
        load_pretrained(broken)
    assert bnb4.QUANT_TYPES == ("nf4", "fp4")


def test_base_stays_4bit_through_a_dtype_cast_and_takes_a_quarter_of_bf16(dirs):
    def nbytes(m, parts):  # the blocks' Linear weights, with the named parts of their quant state
        return sum(t.numel() * t.element_size() for n, t in m.state_dict().items()
                   if ".layers." in n and n.rsplit(".", 2)[-2].endswith("_proj") and n.rsplit(".", 1)[-1] in parts)
    q = load_pretrained(dirs["nf4"], dtype=torch.float32)  # a model-wide cast leaves the quant state as stored
    down = q.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.uint8 and down.weight_nested_absmax.dtype == torch.float32
    assert q.model.norm.weight.dtype == torch.float32
    assert torch.equal(down.weight_nested_absmax, load_file(str(dirs["nf4"] / "model.safetensors"))[
        "model.layers.0.mlp.down_proj.weight.nested_absmax"])
    bf16 = nbytes(load_pretrained(dirs["src"]), {"weight"})
    per_weight = nbytes(q, {"weight", "weight_absmax", "weight_nested_absmax"}) / bf16
    # 4 bits + one absmax byte per 64 weights, against 16 bits (+ one float32 per tensor of <= 256 blocks here)
    assert abs(per_weight - (0.5 + 1 / 64) / 2) < 1e-3, per_weight
    tables = nbytes(q, {"weight_quant_map", "weight_nested_quant_map", "weight_quant_state"}) / 14
    assert tables < 64 + 1024 + 200, tables  # per tensor: the two codes and the JSON, whatever its size
