"""Fixtures that serve tests/train only."""

import subprocess
from pathlib import Path

import pytest

from tests.conftest import built_once


@pytest.fixture(scope="session")
def torchrun_launch(tmp_path_factory):
    """docs/many-gpus.md's torchrun line, run once for tests/train/test_launchers.py and tests/train/test_train.py
    (each launch starts three processes): (the finished process, its recipe, its run folder). Under pytest-xdist the
    two files may run on two workers: built_once launches once and the other worker reads the record."""
    from tests.train.test_launchers import launch

    def run(folder: Path) -> dict:
        done, recipe, out = launch("torchrun", folder)
        return {"argv": done.args, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                "recipe": str(recipe), "out": str(out)}

    seen = built_once(tmp_path_factory, "torchrun", run)
    done = subprocess.CompletedProcess(seen["argv"], seen["returncode"], seen["stdout"], seen["stderr"])
    return done, Path(seen["recipe"]), Path(seen["out"])
