"""Writes inside a folder retrofit owns never leave it: a symbolic link inside (a subfolder, a file, the lock, the
marker) is refused, the marker is created exclusively, and every verb that rewrites a retrofit folder takes its lock.
A downloaded or copied run folder may hold such links; the user's files they point at stay byte for byte as they were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError
from retrofit.io import atomic
from tests.cli.test_output_folders import checksums, counting_run
from tests.evaluate.test_report import fake_results

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def users_folder(root: Path) -> Path:
    """The user's own folder a link points into: results of their own and a file they care about."""
    mine = root / "mine"
    mine.mkdir()
    (mine / "results.md").write_text("my results, written by hand\n")
    (mine / "results.json").write_text('{"mine": true}\n')
    (mine / "precious.txt").write_text("precious\n")
    return mine


def experiment_folder(root: Path) -> Path:
    """A marked experiment folder as `retrofit experiment` leaves it (results.json, eval/), built from hand-written
    results (no model needed)."""
    folder = root / "exp"
    folder.mkdir()
    (folder / atomic.MARKER).write_text("made by retrofit\n")
    arm = {"patch": {"norm": "avnorm"}, "settings": {"lr": None}, "failed": None, "train_loss": None, "recovery": None}
    results = {"schema": "retrofit.experiment/1", "recipe": "r", "hardware": {}, "wall_time_s": {"base": 1.0},
               "base": "base", "arms": {"avnorm": arm}, "control": "softmax", "seeds": None,
               "evaluation": fake_results(), "reference": None}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


@pytest.mark.parametrize("link", ["eval", "eval/results.md", "eval/loss_vs_length.png", ".lock"])
def test_report_never_writes_through_a_link_in_the_folder(link, tmp_path, run_cli):
    """`retrofit report DIR` of a marked experiment whose eval/ (or a file in it, or its lock) is a link to the
    user's folder overwrote the user's results.md (eval/), their file (a plot written through, the lock truncated)."""
    mine, folder = users_folder(tmp_path), experiment_folder(tmp_path)
    target = {"eval": mine, ".lock": mine / "precious.txt"}.get(link, mine / "precious.txt")
    if "/" in link:
        (folder / "eval").mkdir()
        (folder / "eval" / atomic.MARKER).write_text("made by retrofit\n")
    os.symlink(target, folder / link)
    before = checksums(mine)
    code, lines, _ = run_cli(["report", str(folder)])
    assert code == 2 and len(lines) == 1, lines
    assert f"{folder / link} is a symbolic link" in lines[0] and "never writes through a link" in lines[0], lines[0]
    assert checksums(mine) == before


def test_a_run_whose_lock_is_a_link_is_refused_before_it_is_opened(tmp_path, run_cli, capsys):
    """`retrofit train --resume RUN` with RUN/.lock a link to the user's file: the lock's open truncated that file and
    wrote a pid into it."""
    mine = users_folder(tmp_path)
    run, _ = counting_run(tmp_path)
    capsys.readouterr()  # the run's own output
    (run / atomic.LOCK).unlink(missing_ok=True)
    os.symlink(mine / "precious.txt", run / atomic.LOCK)
    before = checksums(mine)
    code, lines, _ = run_cli(["train", str(tmp_path / "run.yaml"), "--resume", str(run)])
    assert code == 2 and len(lines) == 1 and ".lock is a symbolic link" in lines[0], lines
    assert checksums(mine) == before
    with pytest.raises(RetrofitError, match=r"\.lock is a symbolic link"):  # the lock itself never follows one
        with atomic.folder_lock(run):
            pass
    assert checksums(mine) == before


def test_adopt_never_writes_through_a_marker_that_is_a_link(tmp_path, run_cli):
    mine = users_folder(tmp_path)
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    os.symlink(mine / "precious.txt", old / atomic.MARKER)
    before = checksums(mine)
    code, lines, _ = run_cli(["adopt", str(old)])
    assert code == 2 and len(lines) == 1 and f"{old / atomic.MARKER} is a symbolic link" in lines[0], lines
    assert checksums(mine) == before
    os.unlink(old / atomic.MARKER)  # a dangling link is no better: it would create the user's path
    os.symlink(tmp_path / "created-elsewhere", old / atomic.MARKER)
    assert run_cli(["adopt", str(old)])[0] == 2 and not (tmp_path / "created-elsewhere").exists()


def test_the_marker_is_created_exclusively_and_never_followed(tmp_path):
    """owned_folder and make_output: an existing marker file is kept; a link in its place is refused, its target
    untouched (the marker was written with write_text, which follows a link)."""
    mine = users_folder(tmp_path)
    kept = atomic.owned_folder(tmp_path / "a")
    text = (kept / atomic.MARKER).read_text()
    assert atomic.owned_folder(kept) == kept and (kept / atomic.MARKER).read_text() == text
    linked = tmp_path / "b"
    linked.mkdir()
    os.symlink(mine / "precious.txt", linked / atomic.MARKER)
    before = checksums(mine)
    with pytest.raises(RetrofitError, match="is a symbolic link"):
        atomic.owned_folder(linked)
    assert checksums(mine) == before


def test_an_atomic_write_below_an_owned_root_refuses_a_linked_folder(tmp_path):
    """The writer itself (not only the verbs' checks): below a marked folder, every component is opened without
    following links (O_NOFOLLOW), so a link swapped in after the check is refused too."""
    mine, root = users_folder(tmp_path), atomic.owned_folder(tmp_path / "run")
    os.symlink(mine, root / "eval")
    before = checksums(mine)
    for write in (lambda: atomic.atomic_write_text(root / "eval" / "results.md", "overwritten\n"),
                  lambda: atomic.atomic_write_text(root / "eval" / "new" / "results.md", "overwritten\n")):
        with pytest.raises(RetrofitError, match=f"{root / 'eval'} is a symbolic link"):
            write()
    assert checksums(mine) == before
    atomic.atomic_write_text(root / "eval2" / "deeper" / "x.md", "made\n")  # missing folders are made, unlinked
    assert (root / "eval2" / "deeper" / "x.md").read_text() == "made\n"
    outside = tmp_path / "plain" / "bench.json"  # outside an owned folder: an ordinary atomic write
    atomic.atomic_write_text(outside, "{}")
    assert outside.read_text() == "{}"


def test_report_takes_the_folder_lock(evaluated_run, tmp_path, run_cli):
    """`retrofit report DIR` rewrote a folder another process was writing (its lock held): refused, naming it."""
    folder = tmp_path / "eval"
    import shutil
    shutil.copytree(evaluated_run / "eval", folder)
    before = checksums(folder)
    with atomic.folder_lock(folder):  # as a running eval or report holds it
        code, lines, _ = run_cli(["report", str(folder)])
        assert code == 2 and len(lines) == 1 and f"in use by process {os.getpid()}" in lines[0], lines
    after = checksums(folder)
    assert {k: v for k, v in after.items() if k != atomic.LOCK} == {k: v for k, v in before.items() if k != atomic.LOCK}
    assert run_cli(["report", str(folder)])[0] == 0  # released: the report goes ahead


def test_adopt_lists_each_name_on_one_line(tmp_path, run_cli):
    """A file name holding a newline or a terminal escape is listed escaped: one line per entry, nothing acted on."""
    old = tmp_path / "old-run"
    old.mkdir()
    for name in ("log.jsonl", "notes\nfake entry", "\x1b[2Jcleared"):
        (old / name).write_text("x")
    code, _, out = run_cli(["adopt", str(old)])
    assert code == 0 and "\x1b" not in out
    entries = [line for line in out.splitlines() if line.startswith("  ")]
    assert entries == ["  \\x1b[2Jcleared  (1 bytes)", "  log.jsonl  (1 bytes)", "  notes\\nfake entry  (1 bytes)"]
