"""An FP8 checkpoint kept FP8 (`fp8 = "keep"`) under FSDP2 on gloo: the frozen FP8 weights cross the
collectives as bytes (kiln.parallel.fsdp.frozen_as_bytes), sharded like any other parameter, and LoRA
on that base over 2 ranks equals one process; expert parallelism over routed experts kept FP8 equals one
process too; the sharded checkpoints of runs kept FP8 (DeepSeek-V4's release) or dequantized export as they should."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.interop.export import export_model
from kiln.models.auto import load_whole
from kiln.parallel.checkpoint import export_sharded, load_sharded
from tests.models.fp8_cases import make_fp8
from tests.models.v4_release import fp8_release_without_mtp
from tests.parallel import fp8_keep_workers as fw
from tests.spawn import spawn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _fp8_release(tiny_factory, tmp_path_factory, family: str, hf_class: str, folder: str):
    """A tiny `family` model written as a block-scaled FP8 release."""
    return make_fp8(tiny_factory(family, "causal-lm"), tmp_path_factory.mktemp(folder) / "fp8", hf_class)


@pytest.fixture(scope="module")
def fp8_dir(tiny_factory, tmp_path_factory):
    return _fp8_release(tiny_factory, tmp_path_factory, "qwen3", "Qwen3ForCausalLM", "fp8-keep")


@pytest.mark.slow
def test_lora_on_an_fp8_base_under_fsdp2_equals_one_process(fp8_dir, tmp_path):
    fw.lora_steps(0, 1, str(fp8_dir), str(tmp_path))
    spawn(fw.lora_steps, 2, (str(fp8_dir), str(tmp_path)))
    one, two = (json.loads((tmp_path / f"facts-{w}.json").read_text()) for w in (1, 2))
    assert two["fp8_tensors"] > 0 and two["at_rest"] == "torch.uint8" and two["state_dict_mismatch"] == []
    assert two["seen_in_forward"] == ["torch.float8_e4m3fn"]
    # Both sides run the same fp32 arithmetic on the same rows; only the order of the batch reductions
    # differs (2 ranks' means averaged vs one mean of 4 rows, gradients reduce-scattered). Each such sum
    # is exact to a few fp32 ulps (1.2e-7 relative); through ~10 reductions per step and 3 steps that is
    # under 1e-6 relative: bounds at 1e-5 keep 10x headroom. Adapters move by LR * grad per step (~1e-2):
    # their differences stay within 1e-5 of that motion, far below it.
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert one["losses"][-1] < one["losses"][0]  # the adapters do train
    a1, a2 = (load_file(str(tmp_path / f"adapters-{w}.safetensors")) for w in (1, 2))
    assert a1.keys() == a2.keys() and len(a1) == 2 * 2 * len(fw.TARGETS)
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.slow
def test_a_unit_of_fp8_weights_only_shards_as_bytes(tmp_path):
    spawn(fw.only_fp8_unit, 2, (str(tmp_path),))
    for rank in range(2):
        r = json.loads((tmp_path / f"only-fp8-rank{rank}.json").read_text())
        assert "Invalid scalar type" in r["raw_error"], r  # control: gloo refuses a float8 all-gather
        assert r["None"] == {"equal": True, "seen": ["torch.float8_e4m3fn"]}
        # a bf16 mixed-precision policy leaves the frozen FP8 weights as stored (no widening to bf16)
        assert r["bf16"] == {"equal": True, "seen": ["torch.float8_e4m3fn"]}


@pytest.fixture(scope="module")
def fp8_moe_dir(tiny_factory, tmp_path_factory):
    return _fp8_release(tiny_factory, tmp_path_factory, "qwen3_moe", "Qwen3MoeForCausalLM", "fp8-keep-moe")


@pytest.mark.slow
def test_expert_parallel_over_experts_kept_fp8_equals_one_process(fp8_moe_dir, tmp_path):
    """ep = 2 (alone, and under FSDP2) on an FP8 release kept FP8: each rank holds and computes with its half of
    the experts, FP8 as stored with their scale grids, and trains the rest to the losses of one process."""
    fw.ep_steps(0, 1, str(fp8_moe_dir), str(tmp_path))
    spawn(fw.ep_steps, 2, (str(fp8_moe_dir), str(tmp_path)))
    one = json.loads((tmp_path / "ep-one-rank0.json").read_text())
    assert one["losses"][-1] < one["losses"][0]  # the non-FP8 weights do train
    for plan in fw.EP_PLANS:
        for rank in range(2):
            r = json.loads((tmp_path / f"ep-{plan}-rank{rank}.json").read_text())
            # two FP8 stacks (gate_up, down; bytes at rest under FSDP2) and their float32 scale grids, each with
            # half of the experts on this rank
            fp8 = "torch.uint8" if "fsdp" in plan else "torch.float8_e4m3fn"
            half = r["num_experts"] // 2
            layers = len(r["held"]) // 4
            want = [(fp8, half), ("torch.float32", half)] * 2 * layers
            assert layers and sorted(map(tuple, r["held"])) == sorted(want), r["held"]
            # the bound of the EP parity tests (tests/parallel/test_parity.py): the same fp32 arithmetic, only the
            # order of the batch reductions and the all-to-all's row order differ (a few ulps per sum)
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
        # the sharded checkpoint exports as the one process saves: FP8 weights and scales as the release stores
        # them (byte for byte), the trained rest within the losses' rounding (moved by LR * grad ~ 1e-3 a step)
        got = load_file(str(export_sharded(tmp_path / f"ep-{plan}-ckpt", tmp_path / f"ep-{plan}-hf") / "model.safetensors"))
        want, release = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "ep-one-model", fp8_moe_dir))
        assert got.keys() == want.keys() == release.keys()
        for k, v in release.items():
            if v.element_size() == 1 or k.endswith("_scale_inv"):
                assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
            else:
                torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def v4_dir(tiny_factory, tmp_path_factory):
    return fp8_release_without_mtp(tiny_factory, tmp_path_factory.mktemp("v4-keep"))


@pytest.fixture(scope="module")
def checkpoints(fp8_dir, v4_dir, tmp_path_factory):
    """The 2-rank sharded checkpoints of fw.keep_and_dequantized_checkpoints (one spawn)."""
    out = tmp_path_factory.mktemp("fp8-checkpoints")
    spawn(fw.keep_and_dequantized_checkpoints, 2, (str(fp8_dir), str(v4_dir), str(out)))
    return out


@pytest.mark.slow
def test_a_dequantized_fp8_run_exports_a_directory_whose_config_says_what_its_tensors_are(fp8_dir, checkpoints,
                                                                                          tmp_path):
    """The default (`fp8 = "dequantize"`): a sharded run reads its rows dequantized and keeps no FP8 pairs, so
    `kiln export --checkpoint` writes plain weights and a config without `quantization_config` (it used to keep
    it: transformers then reads plain tensors as FP8 ones with no scales); one process's export of the same
    release writes the release's FP8 bytes back under it. transformers reads both as kiln computes them."""
    from kiln.interop.verify import verify_export

    one = load_whole(fp8_dir, task="causal-lm", seed=0)  # whole: the FP8 pairs kept (Fp8State.originals)
    for out in (export_sharded(checkpoints / "deq-ckpt", tmp_path / "sharded"), export_model(one, tmp_path / "one")):
        cfg = json.loads((out / "config.json").read_text())
        weights = load_file(str(out / "model.safetensors"))
        fp8 = sorted(k for k, v in weights.items() if v.dtype == torch.float8_e4m3fn)
        if out.name == "sharded":  # plain float32 throughout, as the run held it
            assert "quantization_config" not in cfg and fp8 == [] and {v.dtype for v in weights.values()} == \
                {torch.float32} and not [k for k in weights if k.endswith("_scale_inv")], cfg
        else:  # the release's FP8 weights and scales, byte for byte, under its quantization_config
            release = load_file(str(fp8_dir / "model.safetensors"))
            assert cfg["quantization_config"] == json.loads((fp8_dir / "config.json").read_text())[
                "quantization_config"] and len(fp8) == 14 and weights.keys() == release.keys()
            assert all(torch.equal(weights[k].view(torch.uint8), release[k].view(torch.uint8)) for k in fp8)
        failed = [c.line() for c in verify_export(out) if not c.ok]  # no missing keys; outputs equal, max diff 0
        assert failed == [], failed


@pytest.mark.slow
def test_a_v4_release_kept_fp8_exports_from_its_shards_as_one_process_does(v4_dir, checkpoints, tmp_path):
    """DeepSeek-V4's release kept FP8, trained under FSDP2 on 2 ranks (read shard by shard, or loaded whole): the
    sharded export writes what one process writes for the same trained state, the release's names (`<module>.scale`,
    not `weight_scale_inv`) and, for what training left untouched, its FP8 bytes (`wo_a`, which the load dequantizes,
    back FP8 with its scale). It used to write `wo_a` in bf16 with no scale and every scale as `weight_scale_inv`."""
    stored = load_file(str(v4_dir / "model.safetensors"))
    fp8 = {k for k, v in stored.items() if v.element_size() == 1 or k.endswith(".scale")}
    wo_a = [f"layers.{i}.attn.wo_a.weight" for i in range(3)]
    assert set(wo_a) < fp8 and not [k for k in stored if k.endswith("_scale_inv")]
    for how in fw.V4_LOADS:
        ckpt = checkpoints / f"v4-{how}"
        one = load_whole(v4_dir, task="causal-lm", fp8="keep", seed=0)  # whole: it keeps wo_a's FP8 pairs
        load_sharded(ckpt, one)  # the same trained state, in one process
        want_dir, got_dir = export_model(one, tmp_path / f"one-{how}"), export_sharded(ckpt, tmp_path / f"sharded-{how}")
        want, got = (load_file(str(d / "model.safetensors")) for d in (want_dir, got_dir))
        # the same names, dtypes and bytes, tensor by tensor, and the same config (quantization_config kept)
        assert list(got) == list(want) and list(got) == list(stored), (how, sorted(set(got) ^ set(stored))[:6])
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(_bytes(got[k]), _bytes(want[k])), (how, k)
        cfg = json.loads((got_dir / "config.json").read_text())
        assert cfg == json.loads((want_dir / "config.json").read_text()) and "quantization_config" in cfg
        # the release's FP8 bytes and scales where training left them (the frozen FP8 modules, layer 0's frozen
        # wo_a); layers 1 and 2's wo_a trained: quantized afresh, FP8 still, as the one process quantizes them
        moved = set(wo_a[1:]) | {w.replace(".weight", ".scale") for w in wo_a[1:]}
        assert [k for k in fp8 - moved if not torch.equal(_bytes(got[k]), _bytes(stored[k]))] == [], how
        assert all(got[w].dtype == stored[w].dtype for w in wo_a) and \
            not any(torch.equal(_bytes(got[w]), _bytes(stored[w])) for w in wo_a[1:]), how
