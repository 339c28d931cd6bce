"""The bad-input world shared by the value tables (test_values, test_values_fallback): built once a session,
since each case proves it left the world's root unchanged and names its own files."""

from __future__ import annotations

import pytest

from tests.cli.bad_inputs_world import World, build_world


@pytest.fixture(scope="session")
def values_world(tmp_path_factory, tiny_factory) -> World:
    return build_world(tmp_path_factory.mktemp("world"), tmp_path_factory.mktemp("elsewhere"), tiny_factory)
