"""Fixtures for the data tests: a small byte-level BPE tokenizer trained once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.tokdata import make_tokenizer_dir


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok") / "bpe")
