"""Build on meta, shard, then read (kiln.parallel.sharded_load): each rank's tensors equal a whole load then
the same plans, bit for bit, in the checkpoint's dtype; each rank holds about its share."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kiln.errors import WeightsError
from kiln.hub.weights import tensor_spans, weight_files
from kiln.models.auto import AutoConfig, from_config, load_whole
from kiln.models.loading.stage import HostStage
from kiln.parallel.sharded_load import empty_pretrained, load_to_device, read_shards
from tests.parallel import sharded_load_workers as sw
from tests.spawn import spawn

QWEN3 = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
           num_experts_per_tok=2, norm_topk_prob=True)


def _save(path, family: str, size: dict, tie: bool = False, task: str = "causal-lm"):
    model = from_config(AutoConfig.for_model(family, tie_word_embeddings=tie, **size), task=task, seed=0)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_bytes=8_000)  # several files and an index
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kiln.interop.tiny import TINY

    root = tmp_path_factory.mktemp("sharded_load")
    return {"qwen3": _save(root / "qwen3", "qwen3", QWEN3), "moe": _save(root / "moe", "qwen3_moe", MOE),
            "tied": _save(root / "tied", "qwen3", QWEN3, tie=True),
            # base models (no head): loaded with one, its tensors are new (kiln.models.loading.fresh)
            "qwen3-base": _save(root / "qwen3-base", "qwen3", QWEN3, task="base"),
            "roberta-base": _save(root / "roberta-base", "roberta", TINY["roberta"], task="base"),
            "adapter": sw.with_adapter(root / "adapter", root / "qwen3")}


@pytest.fixture(scope="module")
def fp8_dir(tiny_factory, tmp_path_factory):
    from tests.models.fp8_cases import make_fp8

    return make_fp8(tiny_factory("qwen3", "causal-lm"), tmp_path_factory.mktemp("sharded_fp8") / "fp8",
                    "Qwen3ForCausalLM")


def test_an_fp8_release_kept_fp8_reads_as_the_whole_load_keeps_it(fp8_dir):
    whole = load_whole(fp8_dir, task="causal-lm", fp8="keep")
    lean = empty_pretrained(fp8_dir, task="causal-lm", fp8="keep")
    read_shards(lean, fp8_dir)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and sum(t.dtype == torch.float8_e4m3fn for t in b.values()) == 14
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(sw._bits(a[k]), sw._bits(b[k])), k
    assert lean.fp8_state.mode == "keep" and lean.fp8_state.scheme == whole.fp8_state.scheme
    assert lean.fp8_state.originals == {} == whole.fp8_state.originals  # every FP8 weight in an FP8 module
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(ids).logits, lean(ids).logits)


def test_fp8_releases_to_dequantize_read_piece_by_piece_as_the_whole_load_dequantizes_them(fp8_dir, fp8_moe_dir):
    """The default (fp8 = "dequantize"): each FP8 weight read with its scale blocks and dequantized as it is read
    (partial blocks: this tiny's 37-wide MLP in 16-blocks; stacked experts too), equal to a whole load's
    dequantization bit for bit; the scales are not reported ignored. One process (`load_to_device`) reads the same
    plan, then the FP8 pairs a whole load keeps (its export writes unchanged weights back from them)."""
    for path in (fp8_dir, fp8_moe_dir):
        whole = load_whole(path, task="causal-lm")
        lean = empty_pretrained(path, task="causal-lm")
        read_shards(lean, path, stage=HostStage(limit=100))
        a, b = whole.state_dict(), lean.state_dict()
        assert a.keys() == b.keys() and {t.dtype for t in b.values()} == {torch.float32}
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert lean.load_report == whole.load_report and whole.fp8_state.originals and not lean.fp8_state.originals
        one = load_to_device(path, "cpu", task="causal-lm")  # one process: then the pairs, as the whole load holds them
        c, d = one.fp8_state.originals, whole.fp8_state.originals
        assert list(c) == list(d) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                          for n in c for x, y in zip(c[n], d[n]))


@pytest.fixture(scope="module")
def fp8_moe_dir(tiny_factory, tmp_path_factory):
    from tests.models.fp8_cases import make_fp8

    return make_fp8(tiny_factory("qwen3_moe", "causal-lm"), tmp_path_factory.mktemp("sharded_fp8_moe") / "fp8",
                    "Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def fp8_moe_v4_names(fp8_moe_dir, tmp_path_factory):
    """The FP8 MoE with its scales under DeepSeek-V4's names: `<module>.scale` for `<module>.weight_scale_inv`."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharded_fp8_v4_names") / "fp8"
    shutil.copytree(fp8_moe_dir, out)
    state = load_file(str(out / "model.safetensors"))
    save_file({k.replace(".weight_scale_inv", ".scale"): v for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def test_scales_under_deepseek_v4_names_read_shard_by_shard_and_export_as_read(fp8_moe_v4_names, tmp_path):
    from safetensors.torch import load_file

    from kiln.parallel.sharded_load import lean_pretrained

    whole = load_whole(fp8_moe_v4_names, task="causal-lm", fp8="keep")
    lean = lean_pretrained(fp8_moe_v4_names, "causal-lm", None, fp8="keep")
    assert lean is not None and lean.fp8_state.scheme.scale_names == ".scale"
    read_shards(lean, fp8_moe_v4_names)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("_scale_inv") for k in b) and lean.load_report.ignored == []
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(sw._bits(a[k]), sw._bits(b[k])), k
    lean.save_pretrained(tmp_path / "out")
    want, got = (load_file(str(d / "model.safetensors")) for d in (fp8_moe_v4_names, tmp_path / "out"))
    assert got.keys() == want.keys() and any(k.endswith(".scale") for k in got)
    assert all(torch.equal(sw._bits(got[k]), sw._bits(want[k])) for k in want)


def test_fp8_experts_kept_fp8_read_expert_by_expert_as_the_whole_load_keeps_them(fp8_moe_dir):
    """Routed experts kept FP8: their stacks and scale grids are read part by part in the stored dtype (through
    a host stage too), never a whole stack at once, and equal the whole load's bytes."""
    whole = load_whole(fp8_moe_dir, task="causal-lm", fp8="keep")
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    for stage in (None, HostStage(limit=100)):
        lean = empty_pretrained(fp8_moe_dir, task="causal-lm", fp8="keep")
        read_shards(lean, fp8_moe_dir, stage=stage)
        a, b = whole.state_dict(), lean.state_dict()
        experts = [k for k in a if ".experts." in k]
        assert a.keys() == b.keys() and {b[k].dtype for k in experts} == {torch.float8_e4m3fn, torch.float32}
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(sw._bits(a[k]), sw._bits(b[k])), k
        assert torch.equal(whole(ids).logits, lean(ids).logits)
    # one expert's part (a (16, 32) FP8 tile, 512 bytes) is the largest piece beyond the 100-byte chunks
    assert stage.peak == 100


@pytest.mark.parametrize("name", ["qwen3", "moe", "tied"])
def test_one_process_read_equals_a_whole_load(dirs, name):
    whole = load_whole(dirs[name], task="causal-lm")
    lean = empty_pretrained(dirs[name], task="causal-lm")
    read_shards(lean, dirs[name])
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(ids).logits, lean(ids).logits)


@pytest.mark.parametrize("name", ["qwen3", "moe"])
def test_a_read_through_the_host_stage_equals_a_whole_load(dirs, name):
    """The path a GPU target takes (file -> one bounded host buffer -> the tensor), run on the CPU: the same
    tensors, and no piece held on the host was bigger than the buffer (stacked experts too: each expert's
    gate and up rows are read straight into their place in the stack)."""
    whole = load_whole(dirs[name], task="causal-lm")
    lean = empty_pretrained(dirs[name], task="causal-lm")
    stage = HostStage(limit=1000)  # ends chunks inside rows and inside elements
    read_shards(lean, dirs[name], "cpu", stage=stage)
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model_bytes = sum(t.nbytes for t in a.values())
    assert stage.peak == 1000 < model_bytes  # chunks only (0 would mean the stage was bypassed)


def test_load_to_device_equals_a_whole_load_then_to(dirs):
    whole = load_whole(dirs["tied"], task="causal-lm", seed=3)
    direct = load_to_device(dirs["tied"], "cpu", task="causal-lm", seed=3)
    assert not direct.training and direct.tokenizer is None and direct.load_report.ignored == []
    a, b = whole.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(ids).logits, direct(ids).logits)


def test_a_run_on_an_accelerator_reads_its_model_straight_to_it(dirs, monkeypatch):
    """kiln train's model on a non-CPU device: built on meta and read there tensor by tensor, never loaded
    whole into host memory (here the 'device' is meta, standing in for a GPU this machine lacks)."""
    from kiln.train.config import parse_run_config
    from kiln.train.recipes import base

    cfg = parse_run_config({"model": {"path": str(dirs["qwen3"]), "task": "causal-lm"},
                            "data": {"train": "unused.jsonl"}, "train": {"out_dir": "unused", "steps": 1, "device": "cpu"}})
    whole = base.build_model(cfg, None, need_tokenizer=False)
    assert next(whole.parameters()).device.type == "cpu"  # on the CPU: the whole load, as before
    monkeypatch.setattr(base, "run_device", lambda cfg: torch.device("meta"))
    monkeypatch.setattr(base, "load_pretrained", lambda *a, **k: pytest.fail("loaded whole into host memory"))
    direct = base.build_model(cfg, None, need_tokenizer=False)
    assert {t.device.type for t in direct.state_dict().values()} == {"meta"}
    assert direct.deferred_read is None


def test_tensors_a_family_carries_beyond_its_model_are_held_by_reference(hook_dirs):
    """A DeepSeek-V3 release's MTP layer (layer num_hidden_layers) has no place in the model; its family's load
    carries it to the export (hf_extras). A read holds each as a meta placeholder and where it lies in the source
    (sharded_carried), reports none ignored; one process (load_to_device) then reads them, as a whole load holds them."""
    from kiln.parallel.sharded_load import lean_pretrained

    src = hook_dirs["v3mtp"]
    whole = load_whole(src)
    n = whole.config.num_hidden_layers
    assert whole.hf_extras and all(k.startswith(f"layers.{n}.") for k in whole.hf_extras)
    lean = lean_pretrained(src, None, None)
    read_shards(lean, src)
    assert lean.load_report.ignored == [] and lean.hf_extras.keys() == whole.hf_extras.keys()
    assert all(t.is_meta for t in lean.hf_extras.values())  # no bytes held
    refs = {name: r for (holder, name), r in lean.carried.refs.items() if holder == "hf_extras"}
    assert {k: (r.key, r.dtype, r.shape) for k, r in refs.items()} == {
        k: ("model." + k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in whole.hf_extras.items()}
    with pytest.raises(WeightsError, match="have no data .*export its sharded checkpoint"):
        lean.save_pretrained(src.parent / "never")
    one = load_to_device(src, "cpu")  # one process: the plan, then the carried tensors read into their holder
    assert list(one.hf_extras) == list(whole.hf_extras) and not one.carried.refs
    assert all(torch.equal(one.hf_extras[k], whole.hf_extras[k]) for k in whole.hf_extras)


def test_an_mtp_layer_made_live_before_the_read_reads_as_on_a_whole_load(hook_dirs):
    """`[moe] mtp_weight` makes the MTP layer live on the model built on meta (before the read): its tensors leave
    the references and become parameters, which the read fills as the whole load's enable_mtp does."""
    from kiln.parallel.sharded_load import lean_pretrained

    src = hook_dirs["v3mtp"]
    whole, lean = load_whole(src, task="causal-lm"), lean_pretrained(src, "causal-lm", None)
    whole.enable_mtp("whole")
    lean.enable_mtp("lean")
    read_shards(lean, src)
    assert lean.hf_extras == {} and lean.load_report.ignored == []
    a, b = whole.hf_state_dict(), lean.hf_state_dict()
    assert a.keys() == b.keys() and "model.layers.2.eh_proj.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def bad_inputs_are_named(model_dir, tmp_path, second_shard: str) -> None:
    """A shard whose tensor shape disagrees with the config, and an index naming a missing shard file (the
    directory's `second_shard`, e.g. "model-00002"), each stop the sharded read with a message naming them."""
    import shutil

    with pytest.raises(WeightsError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape .*expects"):
        empty_pretrained(model_dir, task="causal-lm", intermediate_size=40)  # the plan: the whole load's checks
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    next(broken.glob(f"{second_shard}-*")).unlink()
    with pytest.raises(WeightsError, match=f"names shard file\\(s\\) that are not in the directory: {second_shard}"):
        empty_pretrained(broken, task="causal-lm")


def test_a_disagreeing_shape_and_a_missing_shard_are_named(dirs, tmp_path):
    bad_inputs_are_named(dirs["qwen3"], tmp_path, "model-00002")


@pytest.fixture(scope="module")
def hook_dirs(tiny_factory, tmp_path_factory):
    """Releases whose family's own load decides something from the checkpoint: a Qwen3.5-MoE with its experts
    fused per layer (exported fused), a DeepSeek-V4 in bfloat16 under DeepSeek's release names (exported under
    them; its norms, sinks and hyper-connection parameters held in float32)."""
    import re

    from safetensors.torch import load_file, save_file

    from kiln.models.deepseek_v4_release import release_name
    from tests.models.v4_release import make_release, tiny_release_source

    root = tmp_path_factory.mktemp("sharded_hooks")
    out = {}
    for name, model_type in (("fused", "qwen3_5_moe"), ("v4", "deepseek_v4")):
        src = tiny_factory(model_type, "causal-lm")
        out[name] = root / name
        shutil.copytree(src, out[name])
        state = load_file(str(src / "model.safetensors"))
        if name == "v4":
            state = {release_name(k): v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        else:  # each layer's experts as one (E, 2I, C) gate_up_proj and one (E, C, I) down_proj
            found = [m for k in state if (m := re.fullmatch(r"(.*\.experts)\.(\d+)\.\w+_proj\.weight", k))]
            num = 1 + max(int(m.group(2)) for m in found)
            per = state
            state = {k: v for k, v in per.items() if ".experts." not in k}
            for p in {m.group(1) for m in found}:
                state[f"{p}.gate_up_proj"] = torch.stack([torch.cat([per[f"{p}.{e}.gate_proj.weight"],
                                                                     per[f"{p}.{e}.up_proj.weight"]]) for e in range(num)])
                state[f"{p}.down_proj"] = torch.stack([per[f"{p}.{e}.down_proj.weight"] for e in range(num)])
        save_file(state, str(out[name] / "model.safetensors"), metadata={"format": "pt"})
    out["v3mtp"] = v3_with_mtp(root / "v3mtp")
    out["v4mtp"] = make_release(tiny_release_source(tiny_factory), root / "v4mtp")  # FP8 release, FP8 MTP layer
    return out


def v3_with_mtp(path):
    """A tiny DeepSeek-V3 release with its MTP layer (layer num_hidden_layers: a copy of the last one's tensors, as
    DeepSeek ships it beside the main layers), in several files (an index)."""
    from safetensors.torch import load_file, save_file

    from kiln.interop.tiny import TINY

    cfg = AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"])
    from_config(cfg, task="causal-lm", seed=0).save_pretrained(path, max_shard_bytes=60_000)
    n, c = cfg.num_hidden_layers, cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    own = {f"model.layers.{n}.{k}": torch.randn(*shape, generator=g) for k, shape in (
        ("enorm.weight", (c,)), ("hnorm.weight", (c,)), ("eh_proj.weight", (c, 2 * c)),
        ("shared_head.norm.weight", (c,)), ("embed_tokens.weight", (cfg.vocab_size, c)),
        ("shared_head.head.weight", (cfg.vocab_size, c)))}
    files = sorted(path.glob("*.safetensors"))
    for f in files:  # each file's share of the last layer, copied as the MTP layer's; its own tensors in the last
        state = load_file(str(f))
        mtp = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in state.items()
               if f"layers.{n - 1}." in k}
        save_file({**state, **mtp, **(own if f == files[-1] else {})}, str(f), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({k.replace(f"layers.{n - 1}.", f"layers.{n}."): v
                                   for k, v in data["weight_map"].items() if f"layers.{n - 1}." in k})
        data["weight_map"].update(dict.fromkeys(own, files[-1].name))
        index.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name", ["fused", "v4"])
def test_a_family_s_own_load_decides_on_a_read_as_on_a_whole_load(hook_dirs, name):
    """What the family's load decides from the checkpoint (the layout and names it exports under, the dtypes it
    trains in) a read decides too: the read model writes the whole load's tensors, names, dtypes and bytes."""
    from kiln.parallel.sharded_load import lean_pretrained

    whole = load_whole(hook_dirs[name], task="causal-lm")
    lean = lean_pretrained(hook_dirs[name], "causal-lm", None)
    read_shards(lean, hook_dirs[name])
    assert [(n, p.dtype) for n, p in whole.named_parameters()] == [(n, p.dtype) for n, p in lean.named_parameters()]
    a, b = whole.hf_state_dict(), lean.hf_state_dict()
    assert a.keys() == b.keys()
    assert any(k.endswith("experts.gate_up_proj") for k in a) if name == "fused" else "embed.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_tensor_a_family_carries_in_its_own_holder_is_held_by_reference(hook_dirs, tmp_path):
    """A tensor the model has no place for that the family's load carries in a holder of its own (a Qwen3.5
    release's `mtp.*` in hf_passthrough): a read holds it by reference, reported used, not ignored."""
    from safetensors.torch import load_file, save_file

    from kiln.parallel.sharded_load import lean_pretrained

    src = tmp_path / "mtp"
    shutil.copytree(hook_dirs["fused"], src)
    state = load_file(str(src / "model.safetensors"))
    save_file({**state, "mtp.fc.weight": torch.ones(4, 4)}, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert list(load_whole(src, task="causal-lm").hf_passthrough) == ["mtp.fc.weight"]
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert lean.load_report.ignored == [] and list(lean.hf_passthrough) == ["mtp.fc.weight"]
    [(where, ref)] = lean.carried.refs.items()
    assert where == ("hf_passthrough", "mtp.fc.weight") and lean.hf_passthrough["mtp.fc.weight"].is_meta
    assert (ref.key, ref.file, ref.shape, ref.dtype) == ("mtp.fc.weight", "model.safetensors", (4, 4), "float32")


# (mode, checkpoint) pairs, each loaded whole then sharded and read shard by shard; all of one world size in one spawn
CASES_2 = [("fsdp", "qwen3"), ("tp", "qwen3"), ("fsdp-lora", "qwen3"), ("ep", "moe"), ("fsdp", "tied"), ("pp", "qwen3"),
           ("pp", "tied"), ("fsdp-lora", "fp8"), ("ep", "fp8moe"), ("ep-fsdp-2", "fp8moe"), ("fsdp", "fp8moe"),
           ("fsdp", "fused"), ("fsdp", "v4"), ("fsdp", "v3mtp"), ("tp", "fp8tp"), ("fsdp-deq", "fp8"), ("tp-deq", "fp8tp"),
           ("ep-deq", "fp8moe"), ("fsdp", "v4fp8"), ("fsdp", "v4mtp"), ("fsdp-deq", "v4mtp")]
# base checkpoints loaded with a head they lack (kiln.models.loading.fresh): name -> (task, labels)
FRESH = {"qwen3-base": ("causal-lm", None), "roberta-base": ("sequence-classification", ["neg", "neu", "pos"])}
CASES_2 += [("fsdp", "qwen3-base"), ("tp", "qwen3-base"), ("pp", "qwen3-base"), ("fsdp-lora", "roberta-base"),
            ("fsdp-adapter", "adapter"), ("tp", "adapter"), ("pp", "adapter")]  # and a PEFT adapter beside the weights
CASES_4 = [("tp-fsdp", "qwen3"), ("ep-fsdp", "moe"), ("pp-fsdp", "qwen3"), ("ep-fsdp", "fp8moe"), ("tp-fsdp", "fp8tp")]
# 4-bit bases (kiln.models.loading.q4), on 2 ranks: (mode, checkpoint of sw.q4_checkpoints, quantize at load)
CASES_Q4 = [("fsdp", "bf16", "nf4"), ("fsdp", "bf16", "fp4"), ("fsdp", "bnb-nf4", None), ("fsdp-lora", "bnb-fp4", None),
            ("pp", "bf16", "nf4")]


# a new head and a PEFT adapter on FP8 and 4-bit bases (read from the plan since issue 44's second loading stop):
# (mode, checkpoint, quantize at load); "-head" a checkpoint loaded with a classifier it lacks (NEW_HEAD)
CASES_BASES = [("fsdp", "fp8-head", None), ("fsdp-deq", "fp8-head", None), ("fsdp-adapter", "fp8-adapter", None),
               ("fsdp", "bnb-nf4-head", None), ("fsdp", "bf16-head", "nf4"), ("fsdp-adapter", "bnb-nf4-adapter", None),
               ("fsdp-adapter", "bf16-adapter", "nf4")]
NEW_HEAD = ("sequence-classification", ["neg", "pos"])


@pytest.fixture(scope="module")
def q4_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_q4")
    out = sw.q4_checkpoints(root)
    return {**out, "bnb-nf4-head": out["bnb-nf4"], "bf16-head": out["bf16"],
            "bnb-nf4-adapter": sw.with_adapter(root / "bnb-nf4-adapter", out["bnb-nf4"]),
            "bf16-adapter": sw.with_adapter(root / "bf16-adapter", out["bf16"])}


@pytest.fixture(scope="module")
def rank_results(dirs, fp8_dir, fp8_moe_dir, hook_dirs, q4_dirs, tiny_factory, tmp_path_factory):
    from tests.models.v4_release import fp8_release_without_mtp
    from tests.parallel.fp8_keep_workers import tp_release

    out = tmp_path_factory.mktemp("sharded_ranks")
    paths = {**dirs, "fp8": fp8_dir, "fp8moe": fp8_moe_dir, **hook_dirs,
             "fp8tp": tp_release(tiny_factory, tmp_path_factory.mktemp("sharded_fp8_tp")),
             "v4fp8": fp8_release_without_mtp(tiny_factory, tmp_path_factory.mktemp("v4fp8"))}
    paths.update({**q4_dirs, "fp8-head": fp8_dir, "fp8-adapter": sw.with_adapter(out / "fp8-adapter", fp8_dir)})
    q4 = [(str(paths[name]), mode, f"{mode}-{name}-{quant}", quant, *(NEW_HEAD if name.endswith("-head") else ()))
          for mode, name, quant in CASES_Q4 + CASES_BASES]
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        spawn(sw.compare_many, world, ([(str(paths[name]), mode, f"{mode}-{name}", None, *FRESH.get(name, ()))
                                        for mode, name in cases]
                                       + (q4 if world == 2 else []), str(out)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", CASES_2 + CASES_4)
def test_each_rank_reads_what_a_whole_load_then_shard_gives(rank_results, mode, name):
    world = 4 if (mode, name) in CASES_4 else 2
    for rank in range(world):
        r = json.loads((rank_results / f"{mode}-{name}-rank{rank}.json").read_text())
        assert r["problems"] == [], (rank, r["problems"][:5])
        if mode.startswith("ep") and not mode.endswith("-deq"):  # each rank its experts only, part by part: half
            assert not [n for n in r["read_whole"] if ".experts." in n], r["read_whole"]
            # (over 4 ranks FSDP splits each rank's experts over dp as well, but not their scales)
            assert world == 4 or r["expert_bytes"] * 2 == r["whole_expert_bytes"], r
        if name == "fp8moe" and not mode.endswith("-deq"):  # as stored: FP8 stacks (bytes under FSDP2), float32 scales
            assert r["expert_dtypes"] == ["torch.float32", "torch.float8_e4m3fn"], r
        if mode in ("fsdp", "pp"):  # every tensor split over 2 ranks, or 2 stages: about half the model each
            assert r["bytes"] <= 0.6 * r["whole_bytes"], r
        if mode.startswith("tp") or (mode == "fsdp-deq" and name != "v4mtp"):  # each rank its rows or columns (under
            assert r["read_whole"] == [], r["read_whole"]  # fsdp its part of them) by slice reads, FP8 scale blocks too
        if mode == "ep-deq" or (mode, name) == ("fsdp-deq", "v4mtp"):  # a stack of FP8 (V4: packed FP4) experts to
            # dequantize is read whole (one at a time), then cut
            assert {n.rpartition(".")[2] for n in r["read_whole"]} == {"gate_up_proj", "down_proj"}, r["read_whole"]
        if name == "fp8tp" and not mode.endswith("-deq"):  # the FP8 Linears split with their scale blocks
            assert r["fp8_split"] == 2 * 7 * 2, r  # 2 layers x 7 Linears, weight and scale
        # what the family carries: the same names; V4's FP8 / FP4 MTP weights with their scales (as stored, where the
        # whole load holds them dequantized and keeps their pairs aside)
        whole, lean = r["carried"]
        assert whole == [n for n in lean if not (name == "v4mtp" and n.endswith(".scale"))], r["carried"]
        if name in ("v3mtp", "v4mtp"):  # its MTP layer held by reference: no bytes of it on any rank
            assert lean and r["carried_bytes"] == 0 and (r["read_whole"] == [] or mode == "fsdp-deq"), r
        if name == "v4mtp":
            assert {n.removesuffix(".scale") + ".weight" for n in lean if n.endswith(".scale")} <= set(whole), lean
            assert any(n.endswith(".scale") for n in lean), lean
        if name == "v4fp8":  # kept: the FP8 modules' rows as stored; wo_a (no FP8 module holds it) its rows and
            assert r["fp8_split"] > 0 and r["read_whole"] == [], r  # their scale blocks, dequantized (sharded_fp8)
        if mode.startswith("fsdp"):  # a trained embedding shards; LoRA's frozen one stays whole (no root gather)
            assert r["embedding_sharded"] == (mode in ("fsdp", "fsdp-deq")), r
        if name in FRESH:  # the new head drawn as the whole load draws it, the generator left where it leaves it
            assert r["initialized"] and r["rng_equal"] and set(r["fresh_bytes"]).isdisjoint(r["read_whole"]), r
            if mode != "pp" or rank == 1:  # (the head lives on the last stage)
                assert r["fresh_bytes"], r
            if mode in ("fsdp", "tp"):  # and each rank keeps its piece only (99 rows of 64 bytes: 50 and 49)
                assert all(mine * 2 <= whole + 64 for mine, whole in r["fresh_bytes"].values()), r["fresh_bytes"]
        if name == "adapter":  # the adapter's tensors (checked equal above), drawn first as the whole load draws them
            assert r["rng_equal"] and r["lora_tensors"] == (4 if mode == "pp" else 8), r
        if mode == "fsdp-lora" and name in FRESH:  # two steps with dropout from there: the same losses, exactly
            whole_run, lean_run = r["steps"]
            assert len(whole_run) == 2 and whole_run == lean_run, r["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,name,quantize", CASES_BASES)
def test_a_new_head_or_an_adapter_on_an_fp8_or_4bit_base_reads_as_a_whole_load_then_shard_gives(rank_results, mode,
                                                                                                 name, quantize):
    """Drawn (a head) or read whole and put on (an adapter) from the plan on each rank, as the whole load draws and
    puts them: every tensor equal after the plans, the generator left where the whole load leaves it."""
    for rank in range(2):
        r = json.loads((rank_results / f"{mode}-{name}-{quantize}-rank{rank}.json").read_text())
        assert r["problems"] == [] and r["rng_equal"], (rank, r["problems"][:5], r["rng_equal"])
        if name.endswith("-head"):
            assert r["initialized"] and r["fresh_bytes"], r


def _read(r: dict, f: str, s) -> int:
    """Bytes of tensor `s` (in file `f`) that a rank's 4-bit reads took."""
    return sum(max(0, min(o + n, s.offset + s.nbytes) - max(o, s.offset)) for g, o, n in r["q4_reads"] if g == f)


@pytest.mark.slow
@pytest.mark.parametrize("mode,name,quantize", CASES_Q4)
def test_each_rank_reads_its_4bit_rows_as_a_whole_load_then_shard_gives(q4_dirs, rank_results, mode, name, quantize):
    """A bitsandbytes-4bit directory (packed bytes), or a bf16 checkpoint quantized at load (each rank quantizes the
    blocks its bytes cover; the ranks' bytes start and end inside blocks): each rank holds a whole load's packed
    bytes and quant state then the same plans, byte for byte, and read no whole 4-bit (or bf16) weight."""
    spans = {(str(f), k): s for f in weight_files(q4_dirs[name]) for k, s in tensor_spans(f).items()
             if k.endswith("_proj.weight")}  # every 4-bit weight: (file, where its bytes lie)
    assert len(spans) == 14
    for rank in range(2):
        r = json.loads((rank_results / f"{mode}-{name}-{quantize}-rank{rank}.json").read_text())
        assert r["problems"] == [], (rank, r["problems"][:5])
        if mode == "pp":  # each stage reads (and quantizes) its own layers' weights only
            assert {k for (f, k), s in spans.items() if _read(r, f, s)} == {k for _, k in spans if f"layers.{rank}." in k}
            continue
        for (f, key), s in spans.items():
            # its half of the bytes, and (quantized at load) at most one block more at each end of its run
            extra = 2 * 64 * s.dtype.itemsize if quantize else 1
            assert 0 < _read(r, f, s) <= s.nbytes / 2 + extra, (rank, key, _read(r, f, s), s.nbytes)
        if mode == "fsdp":  # about half the model each (LoRA's frozen embedding and head stay whole on every rank)
            assert r["bytes"] <= 0.7 * r["whole_bytes"], r


def test_a_model_built_on_meta_answers_the_packing_question(dirs):
    """SFT asks `packs_samples` before any weight is read: a meta-built model asks its family's tiny model."""
    lean = empty_pretrained(dirs["qwen3"], task="causal-lm")
    assert next(lean.parameters()).is_meta
    assert lean.packs_samples() == load_whole(dirs["qwen3"], task="causal-lm").packs_samples() is True



# In a fresh process: the host memory a read to DEVICE adds at its peak (memory freed earlier in the pytest
# process stays resident in the heap and would hide it), after the CUDA context is up.
_RISE = """
import sys, torch
from kiln.parallel.sharded_load import load_to_device
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")
def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = kb("VmRSS")
model = load_to_device(sys.argv[1], sys.argv[2], task="causal-lm")
print((kb("VmHWM") - before) * 1024)
"""


def host_rise(path, device: str) -> int:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RISE, str(path), device], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return int(out.stdout.split()[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_read_never_holds_the_model_in_host_memory(tmp_path):
    """~0.3 GiB of bf16 weights read to the GPU: the host's peak rises by about the 64 MiB stage, never by the
    model (read to the CPU, the same measure rises by the model's bytes); the tensors equal a whole load moved
    to the GPU."""
    size = dict(QWEN3, vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    model = from_config(AutoConfig.for_model("qwen3", **size), task="causal-lm", seed=0).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_bytes=100 << 20)
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    del model
    rise = host_rise(tmp_path, "cuda")
    assert rise < 0.4 * model_bytes, (rise, model_bytes)
    direct = load_to_device(tmp_path, "cuda", task="causal-lm")
    whole = load_whole(tmp_path, task="causal-lm").to("cuda")
    a, b = whole.state_dict(), direct.state_dict()
    assert {t.device.type for t in b.values()} == {"cuda"}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("mode,name,quantize", [c for c in CASES_Q4 if c[0].startswith("fsdp")])
def test_plan_weights_are_a_4bit_ranks_bytes(q4_dirs, rank_results, mode, name, quantize):
    """`kiln plan`'s 4-bit weights term under FSDP2 on 2 ranks equals what each rank holds after the sharded read
    (packed bytes halved, quant state whole; their mean: FSDP2's dim-0 chunks split a tensor's odd row 1 + 0), and
    one process's equals the whole load's; the quant-state JSON estimated (4 bytes a weight of slack)."""
    from tests.parallel.test_memory_plan import q4_plan_weights

    ranks = [json.loads((rank_results / f"{mode}-{name}-{quantize}-rank{r}.json").read_text()) for r in range(2)]
    slack = 14 * 4 if quantize else 1
    lora = mode == "fsdp-lora"
    assert abs(q4_plan_weights(q4_dirs[name], quantize, 2, lora) - sum(r["bytes"] for r in ranks) / 2) <= slack
    assert abs(q4_plan_weights(q4_dirs[name], quantize) - ranks[0]["whole_bytes"]) <= slack
