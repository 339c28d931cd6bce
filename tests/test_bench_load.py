"""benchmarks/bench_load.py's arithmetic and run files: the parameter counts it divides by (the 16-bytes-per-parameter
floor) equal transformers' own models of those shapes, and every run's TOML is a valid run config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_load as bench


def _hf_count(kind: str, shape: dict) -> int:
    import transformers

    cls, cfg = ((transformers.Qwen3ForCausalLM, transformers.Qwen3Config) if kind == "dense"
                else (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig))
    with torch.device("meta"):
        return sum(p.numel() for p in cls(cfg(**shape)).parameters())


@pytest.mark.parametrize("kind,untied", [("dense", False), ("dense", True), ("moe", False), ("moe", True)])
def test_parameter_counts_match_transformers(kind, untied):
    # the untied variants are the control: the head term must be counted exactly when the head is its own tensor
    shape = dict(bench.DENSE if kind == "dense" else bench.MOE, tie_word_embeddings=not untied)
    ours = bench.dense_params(shape) if kind == "dense" else bench.moe_params(shape)
    assert ours == _hf_count(kind, shape)


def test_bench_shapes_are_about_one_billion():
    assert 0.9e9 <= bench.dense_params(bench.DENSE) <= 1.2e9
    assert 0.9e9 <= bench.moe_params(bench.MOE) <= 1.2e9


def test_every_run_toml_is_a_valid_run_config(tmp_path):
    from kiln.train.config import load_run_config

    model = tmp_path / "model"
    model.mkdir()
    chats = tmp_path / "chats.jsonl"
    chats.write_text("")
    for run in bench.RUNS:
        cfg = load_run_config(bench.write_toml(tmp_path, run, model, chats), [])
        assert (cfg.lora is None) == (run.targets is None), run.name
        # train.batch_size is per process: BATCH rows on every rank, whatever the process count (a pipeline's
        # stages share one batch: BATCH rows per micro-batch)
        micro = cfg.parallel.microbatches if cfg.parallel is not None and cfg.parallel.pp > 1 else 1
        assert cfg.train.batch_size == bench.BATCH * micro and cfg.data.max_length == bench.MAX_LENGTH
        for key, value in run.parallel.items():
            assert getattr(cfg.parallel, key) == value, (run.name, key)


def test_the_beyond_memory_checkpoint_is_the_smallest_above_its_target():
    for target in (3 * 2 ** 30, 6 * 2 ** 30):
        s = bench.large_shape(target)
        fewer = dict(s, num_hidden_layers=s["num_hidden_layers"] - 1)
        assert 2 * bench.dense_params(s) > target >= 2 * bench.dense_params(fewer)
    assert bench.dense_params(dict(bench.LARGE, num_hidden_layers=2)) == _hf_count(
        "dense", dict(bench.LARGE, num_hidden_layers=2))
