"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids oversubscription stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def torchrun_launch(tmp_path_factory):
    """docs/many-gpus.md's torchrun line, run once for tests/test_launchers.py and tests/test_train.py (each launch
    starts three processes): (the finished process, its recipe, its run folder)."""
    from tests.test_launchers import launch
    return launch("torchrun", tmp_path_factory.mktemp("torchrun"))
