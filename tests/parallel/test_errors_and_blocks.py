"""User errors of the [parallel] table, by message; activation checkpointing and compile keep the math."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.interop.tiny import TINY
from kiln.models import REGISTRY, AutoConfig
from kiln.models.auto import from_config
from kiln.parallel.apply import parallelize
from kiln.parallel.blocks import apply_activation_checkpointing, compile_blocks, find_blocks, part
from kiln.parallel.ep import expert_modules
from kiln.parallel.mesh import Degrees, check_model, resolve_degrees
from kiln.train.config import ParallelSection, parse_run_config
from tests.parallel import workers


def test_degrees_must_multiply_to_the_world_size():
    assert resolve_degrees(ParallelSection(tp=2), 4) == Degrees(dp=2, ep=1, tp=2)
    assert resolve_degrees(ParallelSection(pp=2, cp=2), 8) == Degrees(dp=2, pp=2, cp=2)
    with pytest.raises(ConfigError, match=r"dp \(3\) x tp \(2\) = 6, but the world size is 4"):
        resolve_degrees(ParallelSection(dp=3, tp=2), 4)
    with pytest.raises(ConfigError, match=r"degrees tp \(3\) = 3 do not divide the world size \(4"):
        resolve_degrees(ParallelSection(tp=3), 4)
    with pytest.raises(ConfigError, match=r"dp \(1\) x pp \(2\) x cp \(2\) = 4, but the world size is 2"):
        resolve_degrees(ParallelSection(dp=1, pp=2, cp=2), 2)


def test_every_rank_knows_its_data_shard():
    d = Degrees(dp=2, pp=2, cp=2, tp=2)  # 16 ranks: tp innermost, pp outermost
    assert d.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "ep": 0, "tp": 1}
    # the tp and cp neighbours of one dp rank, on every stage, read the same rows
    assert [d.data_shard(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2


def test_tp_must_divide_the_heads():
    model = workers.build("qwen3")  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide the model's num_attention_heads \(4\)"):
        check_model(Degrees(tp=3), model)
    with pytest.raises(ConfigError, match=r"parallel.tp = 4 does not divide the model's num_key_value_heads \(2\)"):
        check_model(Degrees(tp=4), model)
    mla = workers.build("deepseek_v3")  # 4 heads, dense MLP 48, experts 8 x 16
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide the model's num_attention_heads \(4\)"):
        check_model(Degrees(tp=3, ep=2), mla)
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 does not divide the model's num_experts \(8\)"):
        check_model(Degrees(tp=2, ep=3), mla)


def test_tp_refuses_a_4bit_base_by_name():
    from kiln.models.common.quant4 import quantize_model

    model = workers.build("qwen3")
    quantize_model(model, "nf4")
    with pytest.raises(ConfigError, match=r"parallel.tp = 2: .*'model.layers.0.self_attn.q_proj' is a 4-bit Linear"):
        check_model(Degrees(tp=2), model)


def test_ep_must_divide_the_experts():
    model = workers.build("qwen3_moe")  # 4 experts
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 does not divide the model's num_experts \(4\)"):
        check_model(Degrees(ep=3), model)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 needs a mixture-of-experts model; qwen3 has no experts"):
        check_model(Degrees(ep=2), workers.build("qwen3"))
    check_model(Degrees(tp=2, ep=2), model)  # TP x EP: attention tensor-parallel, experts expert-parallel
    check_model(Degrees(ep=2), model, fsdp=True)  # experts FSDP over dp, the rest over dp x ep


# The MLA plan names q_proj and q_b_proj (without / with a query latent): each family's tiny config has one
PLAN_COVERED_BY = {"deepseek_v3": ("deepseek_v3", "deepseek_v32"), "deepseek_v32": ("deepseek_v3", "deepseek_v32"),
                   "glm_moe_dsa": ("deepseek_v3", "glm_moe_dsa")}


def _meta_model(model_type: str, task: str):
    cfg = AutoConfig.for_model(model_type, **{**TINY[model_type], "tie_word_embeddings": False})
    with torch.device("meta"):
        return REGISTRY[model_type].build(cfg, task)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "mamba", "deepseek_v3", "deepseek_v32",
                                        "glm_moe_dsa"])
@pytest.mark.parametrize("task", ["base", "causal-lm"])
def test_every_path_of_a_declared_plan_is_in_the_built_model(model_type, task):
    model = _meta_model(model_type, task)
    plan = model.family.parallel_plan
    blocks = model.get_submodule(plan.blocks)
    assert isinstance(blocks, torch.nn.ModuleList) and find_blocks(model) is blocks
    seen = set()
    for other in PLAN_COVERED_BY.get(model_type, (model_type,)):
        for block in _meta_model(other, task).get_submodule(plan.blocks):
            # a block lacks what its kind has not (a MoE block no dense MLP, a dense block no shared experts)
            for path in plan.colwise + plan.rowwise + tuple(name for name, _ in plan.shared_by_heads):
                found = part(block, path)
                assert found is None or isinstance(found, torch.nn.Linear), path
                seen.update([path] if found is not None else [])
    assert seen == set(plan.colwise + plan.rowwise + tuple(name for name, _ in plan.shared_by_heads))
    for block in blocks:
        for path in plan.head_norms + plan.norms + tuple(name for name, _ in plan.gathered):
            block.get_submodule(path)
    for path in (plan.embedding, plan.final_norm):
        if path is not None:
            model.get_submodule(path)
    assert (plan.lm_head is not None and task == "causal-lm") == (part(model, plan.lm_head) is not None)
    assert bool(expert_modules(model)) == (model_type not in ("llama", "qwen2", "qwen3", "mamba"))


def test_families_without_a_tensor_plan_are_refused_by_name():
    bert = from_config(AutoConfig.for_model("bert", **TINY["bert"]), task="base", seed=0)
    with pytest.raises(ConfigError, match=r"parallel.tp = 2: bert declares no tensor-parallel plan"):
        check_model(Degrees(tp=2), bert)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 needs a mixture-of-experts model; bert has no experts"):
        check_model(Degrees(ep=2), bert)
    with pytest.raises(ConfigError, match=r"parallel.tp = 2: mamba declares no tensor-parallel plan"):
        check_model(Degrees(tp=2), from_config(AutoConfig.for_model("mamba", **TINY["mamba"]), seed=0))
    with pytest.raises(ConfigError, match=r"parallel.tp = 2: Linear declares no tensor-parallel plan"):
        check_model(Degrees(tp=2), torch.nn.Linear(2, 2))
    tied = from_config(AutoConfig.for_model("qwen3", **{**workers.DENSE, "tie_word_embeddings": True}),
                       task="causal-lm", seed=0)
    check_model(Degrees(tp=2), tied)  # the tied head stays the (vocabulary-sharded) embedding
    assert len(find_blocks(bert)) == TINY["bert"]["num_hidden_layers"]  # no plan: the largest ModuleList


def test_parallelize_checks_the_model_before_anything_else():
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide"):
        parallelize(workers.build("qwen3"), workers.plan(tp=3), world_size=3)


@pytest.mark.parametrize("table,message", [
    ({"tp": 0}, "parallel.tp must be >= 1, got 0"),
    ({"offload": True}, "parallel.offload needs parallel.fsdp = true"),
    ({"fsdp": True, "cadence": {}}, "parallel.cadence is a data-parallel mode"),
    ({"cadence": {"anchor": 20, "max_staleness": 8}}, "parallel.cadence.anchor must be within 1..max_staleness (8)"),
    ({"cadence": {"target_sync_share": 1.5}},
     "parallel.cadence.target_sync_share must be a finite number > 0 and < 1, got 1.5"),
    ({"activation_checkpointing": "some"}, "parallel.activation_checkpointing"),
    ({"pipeline": 2}, "unknown key 'parallel.pipeline'"),
    ({"pp": 2, "pp_stages": [3]}, "parallel.pp_stages has 1 entries but parallel.pp = 2"),
    ({"pp": 2, "pp_stages": [3, 0]}, "every stage needs at least one block"),
    ({"cp": 0}, "parallel.cp must be >= 1"),
    ({"pp": 2, "cadence": {}}, "cannot be combined with tp, ep, pp, cp or fsdp"),
])
def test_bad_parallel_table(table, message):
    data = {"model": {"path": "x"}, "data": {"train": "t.jsonl"}, "train": {"steps": 1}, "parallel": table}
    with pytest.raises(ConfigError) as e:
        parse_run_config(data, "run.toml")
    assert message in str(e.value)


def _loss_and_grads(model) -> tuple[torch.Tensor, dict]:
    ids = workers.batch()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_keeps_loss_and_grads(mode):
    want_loss, want = _loss_and_grads(workers.build("qwen3"))
    model = workers.build("qwen3")
    assert apply_activation_checkpointing(model, mode) == 2
    names = [n for n, _ in model.named_parameters()]
    got_loss, got = _loss_and_grads(model)
    assert names == list(want)  # names (hence checkpoints and key maps) unchanged
    assert torch.equal(got_loss, want_loss)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)


def test_compiled_blocks_keep_loss_and_grads():
    want_loss, want = _loss_and_grads(workers.build("qwen3"))
    model = workers.build("qwen3")
    assert compile_blocks(model, backend="aot_eager") == 2
    got_loss, got = _loss_and_grads(model)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    assert set(model.state_dict()) == set(workers.build("qwen3").state_dict())


def test_kiln_train_checks_degrees_against_the_launched_world(tmp_path):
    from tests.kiln_cli import kiln_cli

    run = tmp_path / "run.toml"
    run.write_text('[model]\npath = "m"\n[data]\ntrain = "t.jsonl"\n[train]\nsteps = 1\n[parallel]\ndp = 2\ntp = 2\n')
    p = kiln_cli("train", "--config", str(run), env={"WORLD_SIZE": "2"})
    assert p.returncode == 1
    assert "dp (2) x tp (2) = 4, but the world size is 2 processes" in p.stderr


def test_a_rank_that_cannot_leave_says_where_it_stuck_and_exits_70():
    """leave_world's watchdog: a rank alive past its teardown budget (here a main thread that never returns)
    prints the message and every thread's stack, and exits 70 instead of hanging `kiln launch`."""
    import subprocess
    import sys

    code = ("import time\nfrom kiln.parallel.world import _exit_watchdog\n_exit_watchdog(0.5, 1)\n"
            "def stuck_in_teardown():\n    time.sleep(60)\nstuck_in_teardown()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 70, p.stderr
    assert "rank 1 did not exit within 0.5 s" in p.stderr
    assert "stuck_in_teardown" in p.stderr

