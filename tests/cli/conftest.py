"""Fixtures that serve tests/cli only."""

import pytest


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Every input the bad-input table names (tests/cli/test_bad_inputs.py build_world: a tiny model, its damaged
    copies, texts, recipes), built once for test_bad_inputs.py and test_output_folders.py; tests only read it."""
    from tests.cli.test_bad_inputs import build_world
    return build_world(tmp_path_factory.mktemp("world"))
