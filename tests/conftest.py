"""Shared fixtures, and one habit of the whole session (pytest_collection_finish)."""

import gc

import pytest
import torch


def pytest_collection_finish(session):
    """Collected, every test module has imported torch, transformers and retrofit: half a million objects that live
    as long as the process. Freezing them (gc.freeze) keeps each full garbage collection from walking them all again:
    retrofit's evaluation collects after every model (retrofit/evaluate/__init__.py), accelerate and pytest collect
    too, and each such collection took ~0.7 s here. Objects made by the tests themselves are collected as before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's last collections at exit see everything again (no leak reports from bindings)


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids oversubscription stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def torchrun_launch(tmp_path_factory):
    """docs/many-gpus.md's torchrun line, run once for tests/train/test_launchers.py and tests/train/test_train.py
    (each launch starts three processes): (the finished process, its recipe, its run folder)."""
    from tests.train.test_launchers import launch
    return launch("torchrun", tmp_path_factory.mktemp("torchrun"))
