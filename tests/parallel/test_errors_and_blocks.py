"""User errors of the [parallel] table, by message; activation checkpointing and compile keep the math."""

from __future__ import annotations

import pytest
import torch

from kiln.parallel.apply import parallelize
from kiln.parallel.blocks import apply_activation_checkpointing, compile_blocks
from kiln.parallel.mesh import Degrees, check_model, resolve_degrees
from kiln.errors import ConfigError
from kiln.train.config import ParallelSection, parse_run_config

import workers


def test_degrees_must_multiply_to_the_world_size():
    assert resolve_degrees(ParallelSection(tp=2), 4) == Degrees(dp=2, ep=1, tp=2)
    with pytest.raises(ConfigError, match=r"dp \(3\) x ep \(1\) x tp \(2\) = 6, but the world size is 4"):
        resolve_degrees(ParallelSection(dp=3, tp=2), 4)
    with pytest.raises(ConfigError, match=r"parallel.tp \(3\) x parallel.ep \(1\) = 3 does not divide the world size \(4"):
        resolve_degrees(ParallelSection(tp=3), 4)


def test_tp_must_divide_the_heads():
    cfg = workers.build("qwen3").config  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide the model's num_attention_heads \(4\)"):
        check_model(Degrees(tp=3), cfg)
    with pytest.raises(ConfigError, match=r"parallel.tp = 4 does not divide the model's num_key_value_heads \(2\)"):
        check_model(Degrees(tp=4), cfg)


def test_ep_must_divide_the_experts():
    cfg = workers.build("qwen3_moe").config  # 4 experts
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 does not divide the model's num_experts \(4\)"):
        check_model(Degrees(ep=3), cfg)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 needs a mixture-of-experts model"):
        check_model(Degrees(ep=2), workers.build("qwen3").config)


def test_parallelize_checks_the_model_before_anything_else():
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide"):
        parallelize(workers.build("qwen3"), workers.plan(tp=3), world_size=3)


@pytest.mark.parametrize("table,message", [
    ({"tp": 0}, "parallel.tp must be >= 1, got 0"),
    ({"offload": True}, "parallel.offload needs parallel.fsdp = true"),
    ({"fsdp": True, "cadence": {}}, "parallel.cadence is a data-parallel mode"),
    ({"cadence": {"anchor": 20, "max_staleness": 8}}, "parallel.cadence.anchor must be within 1..max_staleness (8)"),
    ({"cadence": {"target_sync_share": 1.5}}, "parallel.cadence.target_sync_share must be within (0, 1)"),
    ({"activation_checkpointing": "some"}, "parallel.activation_checkpointing"),
    ({"pp": 2}, "unknown key 'parallel.pp'"),
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
    from kiln_cli import kiln_cli

    run = tmp_path / "run.toml"
    run.write_text('[model]\npath = "m"\n[data]\ntrain = "t.jsonl"\n[train]\nsteps = 1\n[parallel]\ndp = 2\ntp = 2\n')
    p = kiln_cli("train", "--config", str(run), env={"WORLD_SIZE": "2"})
    assert p.returncode == 1
    assert "dp (2) x ep (1) x tp (2) = 4, but the world size is 2 processes" in p.stderr
