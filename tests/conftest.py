"""Fixtures for every folder, and one habit of the whole session (pytest_collection_finish). A fixture that serves
one folder lives in that folder's conftest.py (tests/cli/conftest.py, tests/train/conftest.py); tests/README.md
lists them all. And what the README's test command, `pytest -n 2 --dist loadscope` (pytest-xdist: two worker
processes, one per core of CI's two, each running whole test modules), needs: one torch thread per worker, and
costly session fixtures built once per run (built_once), not once per worker."""

import gc
import json
import os

import pytest
import torch
from filelock import FileLock


def pytest_collection_finish(session):
    """Collected, every test module has imported torch, transformers and retrofit: half a million objects that live
    as long as the process. Freezing them (gc.freeze) keeps each full garbage collection from walking them all again:
    retrofit's evaluation collects after every model (retrofit/evaluate/__init__.py), accelerate and pytest collect
    too, and each such collection took ~0.7 s here. Objects made by the tests themselves are collected as before."""
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    """In each of `-n N`'s workers, torch and the processes its tests start compute on one thread: the N workers share
    the cores, and each one's default of a thread per core would oversubscribe them. The modules are handed out in
    the order pytest_collection_modifyitems gives them (xdist's own, most tests first, ends on few long ones)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    elif getattr(config.option, "dist", "no") == "loadscope":
        config.option.loadscopereorder = False


LONG = ("subprocess", "torch.compile", "nbclient")  # in a test module's source: it starts processes or compiles


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the modules that start processes or compile (most of the long ones: launches, the demo,
    notebooks, compiled models) come first, so the run does not end on one of them while the other worker idles.
    The sort is stable: within each half, the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    long = {}
    for item in items:
        path = item.path
        if path not in long:
            long[path] = any(word in path.read_text() for word in LONG)
    items.sort(key=lambda item: not long[item.path])


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's last collections at exit see everything again (no leak reports from bindings)


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids oversubscription stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_cli(capsys):
    """`retrofit ARGV` run in this process, as `python -m retrofit` runs it: returns (exit code, the non-empty lines
    of stderr, stdout). argparse's usage errors exit from inside main(); they are caught and returned the same way."""
    from retrofit.cli import main

    def run(argv: list) -> tuple[int, list[str], str]:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, [line for line in captured.err.splitlines() if line.strip()], captured.out
    return run


@pytest.fixture(scope="session")
def evaluated_run(tmp_path_factory):
    """A finished tiny counting run with `retrofit eval --out RUN/eval` results in it (their JSON names this
    machine's paths), built once: push's link tests (tests/hub) and the eval lock test (tests/cli) only read it."""
    from retrofit.cli import main
    from tests.cli.test_output_folders import counting_run
    root = tmp_path_factory.mktemp("push-links")
    run, _ = counting_run(root)
    assert main(["eval", str(run), "--lengths", "32", "--trials", "2", "--no-progress",
                 "--out", str(run / "eval")]) == 0
    assert str(run) in (run / "eval" / "results.json").read_text()  # the local path the push must not publish
    return run


def built_once(tmp_path_factory, name: str, build) -> dict | list:
    """`build(folder)`'s JSON-able result, built once per test run however many pytest-xdist workers ask (a session
    fixture alone is built once per worker): the first to ask builds in the folder the workers share, under a file
    lock; the others wait for it and read the result it recorded."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    record = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not record.is_file():
            (shared / name).mkdir()
            record.write_text(json.dumps(build(shared / name)))
        return json.loads(record.read_text())
