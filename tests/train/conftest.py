"""Fixtures that serve tests/train only."""

import pytest


@pytest.fixture(scope="session")
def torchrun_launch(tmp_path_factory):
    """docs/many-gpus.md's torchrun line, run once for tests/train/test_launchers.py and tests/train/test_train.py
    (each launch starts three processes): (the finished process, its recipe, its run folder)."""
    from tests.train.test_launchers import launch
    return launch("torchrun", tmp_path_factory.mktemp("torchrun"))
