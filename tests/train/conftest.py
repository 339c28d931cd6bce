"""Fixtures for tests/train (helpers live in train_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.train_helpers import make_model_dir, make_rows, write_jsonl


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "bert")


@pytest.fixture(scope="session")
def tiny_dir_nodrop(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny0") / "bert", dropout=0.0)


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    return write_jsonl(d / "train.jsonl", make_rows(48, 1)), write_jsonl(d / "eval.jsonl", make_rows(18, 2))
