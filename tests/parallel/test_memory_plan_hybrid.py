"""kiln plan on the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5), checkpoints written by transformers: the attention's
q_proj emits an output gate beside the query (twice the rows), which the family declares, and a Qwen3.5 release's
MTP module (`mtp.*`) is counted as the load holds it (kiln.parallel.sharded_carried)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import WeightsError
from kiln.parallel.memory import plan_memory
from tests.parallel.test_memory_plan import write_run


def _terms(tmp_path: Path, model: Path, nproc: int, extra: str = "") -> dict[str, int]:
    from kiln.cli.plan import plan_inputs
    from kiln.train.config import load_run_config

    cfg = load_run_config(write_run(tmp_path, model, f"[parallel]\nfsdp = {str(nproc > 1).lower()}\n{extra}"), [])
    params, dims, s, sizes, _ = plan_inputs(cfg, nproc, "cpu")
    return plan_memory(params, dims, s, sizes, runtime=0).ranks[0].terms


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


@pytest.fixture(scope="module")
def qwen3_5_with_mtp(tiny_factory, tmp_path_factory) -> Path:
    """A tiny Qwen3.5 text checkpoint from transformers, with the depth-1 MTP module a release ships (`mtp.*`,
    drawn fresh by kiln and saved under the release's names)."""
    from kiln.models.auto import load_pretrained

    model = load_pretrained(tiny_factory("qwen3_5_text", "causal-lm"))
    model.enable_mtp("test", fresh=True)
    out = tmp_path_factory.mktemp("qwen3_5_mtp")
    model.save_pretrained(out, max_shard_bytes=60_000)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_a_hybrid_plans_the_weights_its_load_holds(tiny_factory, tmp_path, monkeypatch, model_type):
    """One process: the weights term is every tensor the load holds, the gradients its parameters'; FSDP2 over 2
    (a sharded read): half of them each."""
    from kiln.models.auto import load_pretrained
    from kiln.models.qwen3_next import HybridConfig
    from kiln.parallel.sharded_load import lean_pretrained, read_shards

    src = tiny_factory(model_type, "causal-lm")
    whole = load_pretrained(src)
    held = _nbytes(whole.state_dict().values())
    assert not getattr(whole, "hf_passthrough", {})
    one = _terms(tmp_path, src, 1)
    assert one["weights"] == one["gradients"] == held
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert 2 * _terms(tmp_path, src, 2)["weights"] == _nbytes(lean.state_dict().values()) == held
    # control: without the family's declaration the headers' q_proj disagrees with config.json
    monkeypatch.setattr(HybridConfig, "attn_output_gate", False)
    with pytest.raises(WeightsError, match=r"q_proj.weight has shape \[128, 32\] but .*implies \[64, 32\]"):
        _terms(tmp_path, src, 1)


def test_qwen3_5_s_mtp_module_is_counted_as_the_load_holds_it(qwen3_5_with_mtp, tiny_factory, tmp_path):
    """Carried (no [moe] mtp_weight): one process holds the MTP tensors whole beside the model (weights, no
    gradients); a sharded read holds them by reference (no bytes). Live (mtp_weight): parameters like any other,
    outside the blocks (FSDP2's root unit)."""
    from kiln.cli.plan import plan_inputs
    from kiln.models.auto import load_pretrained
    from kiln.parallel.sharded_load import lean_pretrained, read_shards
    from kiln.train.config import load_run_config

    src = qwen3_5_with_mtp
    whole = load_pretrained(src)
    model, mtp = _nbytes(whole.state_dict().values()), _nbytes(whole.hf_passthrough.values())
    assert mtp > 0.2 * model and all(k.startswith("mtp.") for k in whole.hf_passthrough)
    one = _terms(tmp_path, src, 1)
    assert (one["weights"], one["gradients"]) == (model + mtp, model)
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert all(t.is_meta for t in lean.hf_passthrough.values())
    assert 2 * _terms(tmp_path, src, 2)["weights"] == _nbytes(lean.state_dict().values()) == model
    live = lean_pretrained(src, "causal-lm", None)
    live.enable_mtp("test")
    read_shards(live, src)
    trained = _terms(tmp_path, src, 1, "[moe]\nmtp_weight = 0.3\n")
    assert trained["weights"] == trained["gradients"] == _nbytes(live.state_dict().values()) == model + mtp
    cfg = load_run_config(write_run(tmp_path, src, "[parallel]\nfsdp = true\n[moe]\nmtp_weight = 0.3\n"), [])
    params = plan_inputs(cfg, 2, "cpu")[0]
    assert {p.block for p in params if p.name.startswith("mtp.")} == {None}


def test_the_cli_says_a_hybrid_s_activations_are_not_modelled(tiny_factory, tmp_path):
    """kiln plan prints the plan, and the family's caveat that its activation term is an underestimate (its blocks
    are not the attention + MLP the formula is derived for); a Qwen3 plan has no such note (control)."""
    from typer.testing import CliRunner

    from kiln.cli.main import app

    for model_type, noted in (("qwen3_next", True), ("qwen3", False)):
        cfg = write_run(tmp_path, tiny_factory(model_type, "causal-lm"))
        r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--set", "parallel.fsdp=true"])
        assert r.exit_code == 0 and "weights" in r.output, r.output
        assert ("activations not modelled" in r.output and "Gated DeltaNet" in r.output) == noted, r.output
