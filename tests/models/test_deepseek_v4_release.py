"""DeepSeek-V4-Flash as released (tests/models/v4_release.py): FP8 dense weights with UE8M0 `<module>.scale` blocks
and FP4 routed experts load as transformers' FP8 loader dequantizes them (every weight, bf16 logits over rows
long enough to reach the HCA compressor); an untouched export is the release byte for byte in its own names and
passes verify-export, changed tensors are re-quantized in their own format, `--dtype bf16` writes plain weights;
`kiln inspect` names the scheme and counts parameters; a LoRA SFT through `kiln train` learns and its merged
export loads in transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import WeightsError
from kiln.hub.fp8 import dequantize, pack_fp4, quantize_fp4, unpack_fp4
from kiln.interop.verify import compare_weights
from kiln.models.auto import load_pretrained
from kiln.models.common.fp8 import Fp8Experts, FP8Linear
from tests.models.causal_cases import same
from tests.models.v4_release import E2M1, fp4_rows, make_release, tiny_release_source

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def release(tiny_factory, tmp_path_factory):
    return make_release(tiny_release_source(tiny_factory), tmp_path_factory.mktemp("v4-release") / "flash")


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


def _ids(length: int = 140) -> torch.Tensor:
    return torch.randint(5, 99, (2, length), generator=torch.Generator().manual_seed(1))


def _transformers(path, block=32):
    q = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(block, block), scale_fmt="ue8m0",
                                          expert_dtype="fp4")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16,
                                                                     quantization_config=q, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return model.eval()


def test_release_loads_as_transformers_dequantizes_it(release):
    on_disk = load_file(str(release / "model.safetensors"))
    assert "layers.0.attn.wkv.scale" in on_disk and on_disk["layers.0.attn.wkv.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8  # FP4, two a byte
    assert on_disk["layers.1.ffn.experts.0.w1.scale"].shape == (32, 2)      # one scale per 32 inputs
    ours, hf = load_pretrained(release), _transformers(release)
    assert ours.load_report.ignored == [] and any(k.startswith("mtp.") for k in on_disk)
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert set(mine) == set(theirs)
    for k, v in theirs.items():  # kiln holds the norms in float32 (values unchanged)
        same(mine[k].to(v.dtype), v, k)
    with torch.no_grad():
        same(ours(input_ids=_ids()).logits, hf(input_ids=_ids()).logits, "bf16 logits over 140 tokens")


def test_fp4_codes_scales_and_rounding():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 64, generator=g) * 3).bfloat16().float()
    w[0, :32] = torch.tensor(E2M1 * 4) * 0.25  # exact grid values, and ties (0.25 * 0.5 ...) below
    packed, scale = quantize_fp4(w)
    ref_packed, ref_scale = fp4_rows(w)
    assert torch.equal(packed, ref_packed) and torch.equal(scale.float(), ref_scale.float())
    # every nibble decodes through the e2m1 table; the error is at most half a grid step of the block's scale
    back = dequantize(packed, scale, None)
    step = scale.float().repeat_interleave(32, dim=1) * 1.0  # the widest e2m1 gap is 2 (4 -> 6): half is 1
    assert bool(((back - w).abs() <= step).all()) and torch.equal(unpack_fp4(pack_fp4(back / step)), back / step)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]])
    assert unpack_fp4(pack_fp4(ties)).tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0]]  # ties to even codes


def test_untouched_export_is_the_release_and_verifies(release, tmp_path):
    r = _run("export", release, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    r = _run("verify-export", tmp_path / "out", "--source", release)
    assert r.exit_code == 0 and "FAIL" not in r.output, r.output
    assert "names/dtypes/bytes identical" in r.output and "FP8 dequantized by its FP8 loader" in r.output
    cfg_in, cfg_out = (json.loads((d / "config.json").read_text()) for d in (release, tmp_path / "out"))
    assert set(cfg_in) <= set(cfg_out) and all(cfg_out[k] == v for k, v in cfg_in.items() if k != "architectures")
    assert set(cfg_out) - set(cfg_in) <= {"mlp_bias", "output_router_logits", "router_aux_loss_coef"}  # defaults

    r = _run("export", release, "--out", tmp_path / "bf16", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert not any(k.endswith(".scale") for k in weights) and "embed.weight" in weights
    assert {v.dtype for k, v in weights.items() if k.endswith(".weight")} == {torch.bfloat16}
    r = _run("verify-export", tmp_path / "bf16")
    assert r.exit_code == 0 and "FAIL" not in r.output, r.output


def test_changed_tensors_requantized_in_their_own_format(release, tmp_path):
    model = load_pretrained(release)
    src = load_file(str(release / "model.safetensors"))
    with torch.no_grad():
        model.model.layers[1].self_attn.kv_proj.weight.mul_(2.0)
        model.model.layers[2].mlp.experts.down_proj[3].mul_(-2.0)
    model.save_pretrained(tmp_path / "changed")
    got = load_file(str(tmp_path / "changed" / "model.safetensors"))
    changed = sorted(k for k in src if not torch.equal(src[k].view(torch.uint8), got[k].view(torch.uint8)))
    # x2 keeps the FP8 codes (only the power-of-two scale moves); x-2 flips the FP4 codes' signs too
    assert changed == ["layers.1.attn.wkv.scale", "layers.2.ffn.experts.3.w2.scale", "layers.2.ffn.experts.3.w2.weight"]
    w2 = "layers.2.ffn.experts.3.w2"
    assert got[w2 + ".weight"].dtype == torch.int8 and got[w2 + ".scale"].dtype == torch.float8_e8m0fnu
    # both changes scale by a power of two: the re-quantized tensors are the old codes with the scales moved
    same(dequantize(got[w2 + ".weight"], got[w2 + ".scale"], None), -2.0 * dequantize(src[w2 + ".weight"],
                                                                                   src[w2 + ".scale"], None), w2)
    wkv = "layers.1.attn.wkv"
    same(dequantize(got[wkv + ".weight"], got[wkv + ".scale"], (32, 32)),
         2.0 * dequantize(src[wkv + ".weight"], src[wkv + ".scale"], (32, 32)), wkv)


def test_keep_mode_holds_fp8_and_fp4_matches_and_writes_the_release_back(release, tmp_path):
    kept, plain = load_pretrained(release, fp8="keep"), load_pretrained(release)
    assert isinstance(kept.model.layers[0].self_attn.kv_proj, FP8Linear)
    experts = kept.model.layers[1].mlp.experts  # FP4 in memory, two a byte, dequantized when they compute
    assert isinstance(experts, Fp8Experts) and experts._parameters["gate_up_proj"].dtype == torch.int8
    with torch.no_grad():
        same(kept(input_ids=_ids(20)).logits, plain(input_ids=_ids(20)).logits, "keep vs dequantize")
    kept.save_pretrained(tmp_path / "out")
    check = compare_weights(tmp_path / "out", release)  # the kept modules' scales under `.scale` again
    assert check.ok, check.detail


def test_inspect_names_the_scheme_and_counts_values_not_scales(release, tmp_path):
    r = _run("inspect", release)
    assert r.exit_code == 0, r.output
    assert "fp8 e4m3 blocks 32x32; routed experts fp4 e2m1, blocks 1x32; scales ue8m0 (<module>.scale)" in r.output
    _run("export", release, "--out", tmp_path / "bf16", "--dtype", "bf16")
    plain = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    count = sum(v.numel() for v in plain.values() if v.dtype.is_floating_point)
    assert f"parameters    {count:,} in" in r.output


def test_release_format_errors_are_named(release, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    state = load_file(str(release / "model.safetensors"))
    state["layers.1.ffn.experts.0.w1.scale"] = state["layers.1.ffn.experts.0.w1.scale"][:, :1].contiguous()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"scale .layers.1.ffn.experts.0.w1.scale. has shape \(32, 1\), but FP4 "
                                           r"weight .* of shape \(32, 64\) \(packed: \(32, 32\)\)"):
        load_pretrained(bad)
    cfg = json.loads((release / "config.json").read_text())
    cfg.pop("expert_dtype")
    (bad / "config.json").write_text(json.dumps(cfg))
    shutil.copy(release / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(WeightsError, match="is packed FP4 .* no expert_dtype 'fp4'"):
        load_pretrained(bad)


def test_the_key_map_names_the_kv_norm_as_transformers_writes_it():
    """Every user of the key map's write names (to_hf, hf_name: the sharded FP8 export, load messages) gets
    transformers' `attn.norm`; the release's `attn.kv_norm` is a read alias, written only by a model that read it."""
    from kiln.models.auto import REGISTRY
    from kiln.models.tasks import BASE, CAUSAL_LM

    family = REGISTRY["deepseek_v4"]
    for task, prefix in ((CAUSAL_LM, "model."), (BASE, "")):  # kiln's names keep `model.`; a base's hf names don't
        keymap = family.keymap(task)
        kiln_name = "model.layers.0.self_attn.kv_norm.weight"
        assert keymap.hf_name(kiln_name) == f"{prefix}layers.0.attn.norm.weight"
        hf, unmatched = keymap.to_hf({kiln_name: torch.ones(4)})
        assert list(hf) == [f"{prefix}layers.0.attn.norm.weight"] and unmatched == []


def test_release_kv_norm_name_loads_trains_and_exports_as_read(release, tiny_factory, tmp_path):
    """The release names the MLA key/value norm `layers.N.attn.kv_norm.weight` (transformers' save writes
    `attn.norm`): it loads into the norm, trains, and an export writes it back under the name read."""
    on_disk = load_file(str(release / "model.safetensors"))
    assert "layers.0.attn.kv_norm.weight" in on_disk and "mtp.0.attn.kv_norm.weight" in on_disk
    assert not any(k.endswith("attn.norm.weight") for k in on_disk)
    model = load_pretrained(release)
    assert model.load_report.ignored == [] and model.load_report.initialized == [], model.load_report.lines()
    norm = model.model.layers[0].self_attn.kv_norm.weight
    assert torch.equal(norm.detach(), on_disk["layers.0.attn.kv_norm.weight"].float())

    model.save_pretrained(tmp_path / "untouched")  # byte for byte the release, its names included
    check = compare_weights(tmp_path / "untouched", release)
    assert check.ok, check.detail

    model.train()  # one step: the norm takes a gradient and moves; the export keeps the release's names
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = _ids(20)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and norm.grad is not None and bool(norm.grad.abs().sum() > 0)
    opt.step()
    model.save_pretrained(tmp_path / "trained")
    got = load_file(str(tmp_path / "trained" / "model.safetensors"))
    assert set(got) == set(on_disk)  # (a trained norm keeps float32: V4TaskModel.hf_state_dict)
    assert not torch.equal(got["layers.0.attn.kv_norm.weight"].float(), on_disk["layers.0.attn.kv_norm.weight"].float())

    # transformers' own spelling still reads, and is written back as it was read
    hf_layout = tiny_release_source(tiny_factory)
    saved = load_file(str(hf_layout / "model.safetensors"))
    assert "model.layers.0.attn.norm.weight" in saved
    load_pretrained(hf_layout).save_pretrained(tmp_path / "hf")
    check = compare_weights(tmp_path / "hf", hf_layout)
    assert check.ok, check.detail
