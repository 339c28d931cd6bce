"""`kiln plan` on a checkpoint that loads whole on every rank whatever the plans (kiln.parallel.sharded_load.read_plan):
its carried tensors found by the family's load on the headers all the same, and its load planned as the whole load."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kiln.parallel.memory import plan_memory
from tests.parallel.test_memory_plan import write_run
from tests.parallel.test_sharded_fp8_mtp import v3_release  # noqa: F401 (a fixture)


def planned(tmp_path: Path, model: Path, today: bool = False):
    """(params, settings, the rank's plan) of `model` under fsdp over 2 processes, on cpu."""
    from kiln.cli.plan import plan_inputs
    from kiln.train.config import load_run_config

    cfg = load_run_config(write_run(tmp_path, model, "[parallel]\nfsdp = true\n"), [])
    params, dims, s, sizes, _ = plan_inputs(cfg, 2, "cpu")
    return params, s, plan_memory(params, dims, s, sizes, today=today, runtime=0).ranks[0]


def test_a_bin_release_with_an_mtp_layer_is_planned_as_the_whole_load_it_is(tmp_path):
    """A tiny DeepSeek-V3 release with its MTP layer saved as .bin loads whole on every rank (carried tensors are
    referenced by their safetensors file): under fsdp over 2 its MTP layer is still carried, not trained (gradients
    and optimizer equal the safetensors release's), held whole on each rank (weights: the .bin's plan is the
    safetensors one plus the layer's bytes), and its load is today's whole read (every rank reads the checkpoint),
    which the table's one column and a line naming the file say."""
    from kiln.cli.main import app
    from kiln.models.auto import load_pretrained
    from tests.parallel.sharded_load_workers import bin_release
    from tests.parallel.test_sharded_load import v3_with_mtp

    src = v3_with_mtp(tmp_path / "mtp")
    pickled = bin_release(src, tmp_path / "bin")
    mtp_bytes = sum(t.nbytes for t in load_pretrained(src).hf_extras.values())

    st_params, st_settings, st = planned(tmp_path, src)
    bin_params, settings, whole = planned(tmp_path, pickled)
    for term in ("gradients", "optimizer"):
        assert whole.terms[term] == st.terms[term], term
    assert sum(p.carried for p in bin_params) == sum(p.carried for p in st_params) == 42
    assert st_settings.loads_whole is None and st_settings.reads_shards
    assert "pytorch_model.bin" in settings.loads_whole and not settings.reads_shards
    assert whole.terms["weights"] == st.terms["weights"] + mtp_bytes  # the layer held whole on each rank
    # the load: today's loader (every rank reads every file, then builds the whole model), not a read by shards
    _, _, today = planned(tmp_path, pickled, today=True)
    assert (whole.terms, whole.load_peak) == (today.terms, today.load_peak)
    assert whole.rank.endswith("(today's loader)")
    ckpt = sum(f.stat().st_size for f in pickled.glob("*.bin"))
    assert whole.load_peak >= ckpt > st.load_peak  # a whole read holds at least the checkpoint; the shard read less
    out = CliRunner().invoke(app, ["plan", "--config", str(write_run(tmp_path, pickled, "[parallel]\nfsdp = true\n")),
                                   "--nproc", "2"])
    assert out.exit_code == 0, out.output
    assert "loads whole on every rank" in out.output and "pytorch_model.bin" in out.output, out.output
    assert "(whole load)" in out.output and "today's loader" not in out.output, out.output
    assert "42 tensors" in out.output and "held whole on each rank" in out.output, out.output


def test_an_fp8_bin_release_s_mtp_layer_is_carried_though_it_loads_whole(v3_release, tmp_path):
    """An FP8 DeepSeek-V3 release saved as .bin loads whole (no read takes FP8 .bin shard by shard); the family's
    load on its headers still finds its MTP layer carried (as its stored pairs), not trained: gradients and optimizer
    equal the safetensors release's, and the load is today's whole read."""
    from tests.parallel.sharded_load_workers import bin_release

    st_params, st_settings, st = planned(tmp_path, v3_release)
    bin_params, settings, whole = planned(tmp_path, bin_release(v3_release, tmp_path / "bin"))
    assert (whole.terms["gradients"], whole.terms["optimizer"]) == (st.terms["gradients"], st.terms["optimizer"])
    assert sum(p.carried for p in bin_params) == sum(p.carried for p in st_params) == 66
    assert st_settings.loads_whole is None and "FP8 or 4-bit .bin" in settings.loads_whole
    assert whole.rank.endswith("(today's loader)") and whole.load_peak > st.load_peak


def test_a_4bit_bin_directory_is_planned_whole_without_a_crash(tiny_factory, tmp_path):
    """A bitsandbytes-4bit directory saved as .bin loads whole; the plan's look at what its family carries reads
    the quant state as safetensors, which a .bin is not: that look gives up (nothing carried), the plan does not."""
    from kiln.interop.export import export_model
    from kiln.parallel.sharded_load import read_plan
    from tests.parallel.sharded_load_workers import bin_release

    export_model(tiny_factory("qwen3", "causal-lm"), tmp_path / "nf4", quantize="nf4")
    pickled = bin_release(tmp_path / "nf4", tmp_path / "bin")
    _model, plan = read_plan(pickled, "causal-lm")
    assert "FP8 or 4-bit .bin" in plan.whole
    _params, settings, whole = planned(tmp_path, pickled)
    assert "FP8 or 4-bit .bin" in settings.loads_whole and whole.rank.endswith("(today's loader)")
