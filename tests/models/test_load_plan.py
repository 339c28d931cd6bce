"""One load plan every load reads (kiln.models.loading, issue 44 item 2): the whole load is the plan's path on one
process, bit for bit the stage-3 whole load (`load_whole`, kept for the cases the plan names), for every registered
family; the plan's sources are typed and inspected here for each kind of checkpoint a sharded mode reads."""

from __future__ import annotations

import pytest
import torch

from kiln.interop.tiny import TINY
from kiln.models import auto
from kiln.models.auto import AutoConfig, from_config, load_pretrained, load_whole
from kiln.models.common.load_plan import Fp8Box, Fresh, LoadPlan, Rows4, Stacked, Stored
from kiln.models.loading import read


@pytest.fixture
def materialized(monkeypatch):
    """The models `materialize` filled (the one materialization), and the whole loads taken instead."""
    calls: dict[str, list] = {"read": [], "whole": []}
    real_read, real_whole = read.materialize, auto.load_whole

    def spy_read(model, *a, **k):
        calls["read"].append(model.deferred_read)
        return real_read(model, *a, **k)

    def spy_whole(*a, **k):
        calls["whole"].append(a[0])
        return real_whole(*a, **k)

    monkeypatch.setattr(auto, "materialize", spy_read)
    monkeypatch.setattr(auto, "load_whole", spy_whole)
    return calls


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y), k
    assert sorted(a.hf_extras) == sorted(b.hf_extras)
    assert all(torch.equal(a.hf_extras[k], b.hf_extras[k]) for k in a.hf_extras)
    assert sorted(a.load_report.ignored) == sorted(b.load_report.ignored)
    assert a.load_report.initialized == b.load_report.initialized
    assert not a.training and not b.training and (a.tokenizer is None) == (b.tokenizer is None)


def _same_pairs_and_exports(plan_model, whole, tmp_path) -> None:
    """The stored FP8 pairs a one-process export writes back held as the whole load holds them (same order, same
    bytes), and the two exports byte for byte the same."""
    a, b = plan_model.fp8_state.originals, whole.fp8_state.originals
    assert list(a) == list(b) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                      for n in a for x, y in zip(a[n], b[n]))
    plan_model.save_pretrained(tmp_path / "plan")
    whole.save_pretrained(tmp_path / "whole")
    for f in sorted(p.name for p in (tmp_path / "whole").iterdir()):
        assert (tmp_path / "plan" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def _task(model_type: str) -> str:
    return next(iter(auto.family_for(model_type).tasks))


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_family_loads_through_its_plan_bit_for_bit_as_the_whole_load(model_type, tiny_factory, materialized):
    path = tiny_factory(model_type, _task(model_type))
    plan_model = load_pretrained(path, seed=1)
    assert len(materialized["read"]) == 1 and materialized["whole"] == [], materialized  # the plan's path, once
    assert isinstance(materialized["read"][0], LoadPlan) and plan_model.deferred_read is None
    _equal(plan_model, load_whole(path, seed=1))


@pytest.mark.parametrize("model_type,task", [("bert", "sequence-classification"), ("qwen3", "sequence-classification"),
                                             ("roberta", "token-classification")])
def test_a_new_head_is_drawn_by_the_plan_as_the_whole_load_draws_it(model_type, task, tiny_factory, materialized):
    path = tiny_factory(model_type, _task(model_type))
    torch.manual_seed(7)
    plan_model = load_pretrained(path, task=task, labels=["a", "b", "c"], seed=3)
    after_plan = torch.get_rng_state()
    plan = materialized["read"][0]
    fresh = {n for n, s in plan.sources.items() if isinstance(s, Fresh)}
    assert fresh and plan.fresh_names and materialized["whole"] == []
    torch.manual_seed(7)
    whole = load_whole(path, task=task, labels=["a", "b", "c"], seed=3)
    assert torch.equal(after_plan, torch.get_rng_state())  # the generator left where the whole load leaves it
    _equal(plan_model, whole)


def test_a_cast_follows_the_plan_s_read(tiny_factory, materialized):
    path = tiny_factory("qwen3", "causal-lm")
    _equal(load_pretrained(path, dtype=torch.float64), load_whole(path, dtype=torch.float64))
    assert len(materialized["read"]) == 1


@pytest.mark.parametrize("kw", [{}, {"dtype": torch.float32}, {"fp8": "keep"}, {"fp8": "keep", "dtype": torch.float32}])
def test_an_fp8_release_loads_through_its_plan_with_the_pairs_a_whole_load_keeps(kinds, kw, materialized, tmp_path):
    """FP8 read dequantized (into `dtype` at once: one rounding) or kept: the stored pairs a one-process export
    writes back are held as the whole load holds them, and the exports are byte for byte the same."""
    plan_model = load_pretrained(kinds["fp8"], task="causal-lm", **kw)
    assert len(materialized["read"]) == 1 and materialized["whole"] == []
    whole = load_whole(kinds["fp8"], task="causal-lm", **kw)
    _equal(plan_model, whole)
    _same_pairs_and_exports(plan_model, whole, tmp_path)


QWEN3 = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(QWEN3, moe_intermediate_size=16, head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, tiny_factory):
    from tests.models.fp8_cases import make_fp8

    root = tmp_path_factory.mktemp("load_plan")
    out = {}
    for name, family, size in (("qwen3", "qwen3", QWEN3), ("moe", "qwen3_moe", MOE)):
        model = from_config(AutoConfig.for_model(family, **size), task="causal-lm", seed=0)
        out[name] = model.to(torch.bfloat16).save_pretrained(root / name, max_shard_bytes=8_000)
    out["fp8"] = make_fp8(tiny_factory("qwen3", "causal-lm"), root / "fp8", "Qwen3ForCausalLM")
    return out


@pytest.mark.parametrize("name,kw,kind,taken", [
    ("qwen3", {}, Stored, True),                              # FSDP2 / TP / PP: rows or boxes of stored tensors
    ("moe", {}, Stacked, True),                               # EP: each rank its experts
    ("fp8", {"fp8": "keep"}, Stored, True),                   # FP8 kept: the FP8 bytes and scales as stored
    ("fp8", {}, Fp8Box, True),                                # FP8 dequantized: boxes and the scale blocks they touch
    ("qwen3", {"quantize": "nf4"}, Rows4, True),              # 4-bit: each rank its packed bytes
])
def test_each_sharded_mode_s_checkpoint_has_one_typed_plan_the_whole_load_reads_too(kinds, name, kw, kind, taken,
                                                                                     materialized):
    from kiln.parallel.sharded_load import lean_pretrained, read_plan

    lean = lean_pretrained(kinds[name], "causal-lm", None, **kw)
    plan = lean.deferred_read
    assert isinstance(plan, LoadPlan) and plan.whole is None and plan.counts().get(kind.__name__, 0) > 0, plan.counts()
    held = {n for n, _ in (*lean.named_parameters(), *lean.named_buffers())}
    q4 = plan.q4.names(lean) if plan.q4 else set()
    assert held - q4 <= set(plan.sources)  # every tensor the model holds has its one source
    _model, looked = read_plan(kinds[name], "causal-lm", kw.get("fp8", "dequantize"), kw.get("quantize"))
    assert looked.sources.keys() == plan.sources.keys() and looked.whole is None  # `kiln plan` reads the same plan
    whole = load_pretrained(kinds[name], task="causal-lm", **kw)
    assert (len(materialized["read"]) == 1) == taken and (materialized["whole"] == []) == taken
    _equal(whole, load_whole(kinds[name], task="causal-lm", **kw))


@pytest.mark.parametrize("name", ["v3mtp", "qwen35mtp"])
def test_tensors_a_family_carries_are_held_on_one_process_as_the_whole_load_holds_them(name, tmp_path, tiny_factory,
                                                                                       materialized):
    """An MTP layer a family carries as stored (not trained): read into its holder after the model, so the export of
    a one-process load writes it back byte for byte as the whole load's does."""
    from tests.parallel.test_sharded_load import v3_with_mtp

    path = v3_with_mtp(tmp_path / "v3") if name == "v3mtp" else _qwen35_with_mtp(tiny_factory, tmp_path / "q35")
    plan_model = load_pretrained(path, task="causal-lm")
    assert len(materialized["read"]) == 1 and materialized["whole"] == [] and not plan_model.carried.refs
    whole = load_whole(path, task="causal-lm")
    _equal(plan_model, whole)
    for holder in ("hf_extras", "hf_passthrough", "mtp_tensors"):
        a, b = getattr(plan_model, holder, None) or {}, getattr(whole, holder, None) or {}
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), holder
    assert any(getattr(whole, h, None) for h in ("hf_extras", "hf_passthrough", "mtp_tensors"))
    plan_model.save_pretrained(tmp_path / "plan")
    whole.save_pretrained(tmp_path / "whole")
    for f in sorted(p.name for p in (tmp_path / "whole").iterdir()):
        assert (tmp_path / "plan" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def _qwen35_with_mtp(tiny_factory, path):
    """A tiny Qwen3.5-MoE release with a tensor of its MTP head (`mtp.*`, carried in hf_passthrough)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_factory("qwen3_5_moe", "causal-lm"), path)
    state = load_file(str(path / "model.safetensors"))
    save_file({**state, "mtp.fc.weight": torch.ones(4, 4)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("kw", [{}, {"dtype": torch.float32}, {"fp8": "keep"}])
def test_a_new_head_on_an_fp8_base_is_drawn_by_the_plan_as_the_whole_load_draws_it(kinds, kw, materialized):
    """The draws' dtype is the one the whole load picks from its prepared weights (dequantized, or kept pairs)."""
    torch.manual_seed(7)
    plan_model = load_pretrained(kinds["fp8"], task="sequence-classification", labels=["a", "b"], seed=3, **kw)
    after_plan = torch.get_rng_state()
    assert len(materialized["read"]) == 1 and materialized["whole"] == [], materialized
    assert any(isinstance(s, Fresh) for s in materialized["read"][0].sources.values())
    torch.manual_seed(7)
    whole = load_whole(kinds["fp8"], task="sequence-classification", labels=["a", "b"], seed=3, **kw)
    assert torch.equal(after_plan, torch.get_rng_state())
    _equal(plan_model, whole)


@pytest.mark.parametrize("kw", [{}, {"fp8": "keep"}])
def test_an_adapter_beside_an_fp8_base_is_put_on_by_the_plan_as_the_whole_load_puts_it(kinds, kw, materialized,
                                                                                        tmp_path):
    from tests.parallel.sharded_load_workers import with_adapter

    path = with_adapter(tmp_path / "fp8_adapter", kinds["fp8"])
    assert (path / "adapter_config.json").is_file() and "quantization_config" in (path / "config.json").read_text()
    materialized["whole"].clear()  # (with_adapter's own load)
    plan_model = load_pretrained(path, task="causal-lm", seed=5, **kw)
    assert len(materialized["read"]) == 1 and materialized["whole"] == [], materialized
    _equal(plan_model, load_whole(path, task="causal-lm", seed=5, **kw))


@pytest.fixture(scope="module")
def q4_dirs(tmp_path_factory):
    from tests.parallel.sharded_load_workers import q4_checkpoints

    return q4_checkpoints(tmp_path_factory.mktemp("load_plan_q4"))


@pytest.mark.parametrize("name,quantize", [("bf16", "nf4"), ("bnb-nf4", None)])
def test_a_new_head_on_a_4bit_base_is_drawn_by_the_plan_as_the_whole_load_draws_it(q4_dirs, name, quantize,
                                                                                    materialized):
    """A head is no backbone Linear: drawn in the load's dtype and left unquantized, by both loads."""
    kw = {"task": "sequence-classification", "labels": ["a", "b"], "seed": 3, "quantize": quantize}
    plan_model = load_pretrained(q4_dirs[name], **kw)
    assert len(materialized["read"]) == 1 and materialized["whole"] == [], materialized
    plan = materialized["read"][0]
    assert plan.q4 and any(isinstance(s, Fresh) for s in plan.sources.values())
    _equal(plan_model, load_whole(q4_dirs[name], **kw))


@pytest.mark.parametrize("name,quantize", [("bf16", "nf4"), ("bnb-nf4", None)])
def test_an_adapter_beside_a_4bit_base_is_put_on_by_the_plan_as_the_whole_load_puts_it(q4_dirs, name, quantize,
                                                                                        materialized, tmp_path):
    from tests.parallel.sharded_load_workers import with_adapter

    path = with_adapter(tmp_path / "q4_adapter", q4_dirs[name])
    materialized["whole"].clear()  # (with_adapter's own load)
    plan_model = load_pretrained(path, task="causal-lm", seed=5, quantize=quantize)
    assert len(materialized["read"]) == 1 and materialized["whole"] == [], materialized
    _equal(plan_model, load_whole(path, task="causal-lm", seed=5, quantize=quantize))


@pytest.fixture(scope="module")
def v4_release(tiny_factory, tmp_path_factory):
    from tests.models.v4_release import make_release, tiny_release_source

    return make_release(tiny_release_source(tiny_factory), tmp_path_factory.mktemp("v4mtp_plan") / "flash")


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_an_fp8_release_s_carried_mtp_layer_is_held_on_one_process_as_the_whole_load_holds_it(v4_release, fp8,
                                                                                             materialized, tmp_path):
    """Each carried FP8 (FP4) pair read and dequantized as the whole load dequantizes it, its scale not held, its
    stored pair kept aside in the whole load's order: the export's bytes are the whole load's."""
    plan_model = load_pretrained(v4_release, task="causal-lm", fp8=fp8)
    assert len(materialized["read"]) == 1 and materialized["whole"] == [] and not plan_model.carried.refs
    whole = load_whole(v4_release, task="causal-lm", fp8=fp8)
    _equal(plan_model, whole)
    a, b = plan_model.mtp_tensors, whole.mtp_tensors
    assert a and list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    _same_pairs_and_exports(plan_model, whole, tmp_path)
