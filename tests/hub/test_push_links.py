"""retrofit push never publishes what a symbolic link points to, in the run or in the eval folder it is given, and
publishes eval results with names, not this machine's paths (issue 26, item 1). The run: tests/conftest.py
evaluated_run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from retrofit.io import atomic
from tests.cli.test_output_folders import checksums

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- canary-secret-3f9a"


LINK = ("retrofit push: error: {where} in {root} is a symbolic link; push never publishes what a link points to: "
        "replace it with a copy of the file, or remove it")


def plant(run: Path, where: str, kind: str, tmp_path: Path) -> str:
    """Plant a link at RUN/where: to a secret file, to a folder of secrets, or to a file inside the run."""
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir(exist_ok=True)
    (secret_dir / "id_ed25519").write_text(SECRET)
    target = {"file": secret_dir / "id_ed25519", "folder": secret_dir, "inside": run / "config.json"}[kind]
    link = run / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        link.rename(link.with_name(link.name + ".real"))
    os.symlink(target, link)
    return where


def unplant(run: Path, where: str) -> None:
    link = run / where
    link.unlink()
    real = link.with_name(link.name + ".real")
    if real.exists():
        real.rename(link)


@pytest.mark.parametrize("where,kind", [
    ("tokenizer_config.json", "file"),          # replaces a published name: /etc/passwd in the issue
    ("chat_template.jinja", "file"),            # a name push would pick up: the private key in the issue
    ("eval/results.md", "file"),                # under eval/, which push copies
    ("eval/results.json", "file"),
    ("eval/plots", "folder"),                   # a link to a folder
    ("notes/deep/key.png", "file"),             # any subfolder
    ("generation_config.json", "inside"),       # a link that stays inside the run: refused the same way
])
def test_push_refuses_a_symbolic_link_before_staging_anything(where, kind, evaluated_run, tmp_path, run_cli):
    run = evaluated_run
    plant(run, where, kind, tmp_path)
    try:
        staged = tmp_path / "staged"
        before = checksums(run)
        code, lines, _ = run_cli(["push", run, "--repo", "me/x", "--dry-run", staged])
        assert code == 2 and lines == [LINK.format(where=where, root=run)], lines
        assert not staged.exists()
        assert checksums(run) == before
        leaked = [p for p in tmp_path.rglob("*") if p.is_file() and "secrets" not in p.parts
                  and SECRET in p.read_text(errors="replace")]
        assert leaked == []
        assert [p.name for p in tmp_path.iterdir()] == ["secrets"]  # no staging folder, no temporary sibling
    finally:
        unplant(run, where)


def test_push_refuses_a_link_in_the_eval_folder_it_is_given(evaluated_run, tmp_path, run_cli):
    elsewhere = tmp_path / "eval-copy"
    elsewhere.mkdir()
    for name in ("results.md", "results.csv"):
        (elsewhere / name).write_bytes((evaluated_run / "eval" / name).read_bytes())
    (tmp_path / "secret.txt").write_text(SECRET)
    os.symlink(tmp_path / "secret.txt", elsewhere / "results.json")
    code, lines, _ = run_cli(["push", evaluated_run, "--repo", "me/x", "--eval", elsewhere,
                              "--dry-run", tmp_path / "staged"])
    assert code == 2 and lines == [LINK.format(where="results.json", root=elsewhere)], lines
    assert not (tmp_path / "staged").exists()


def test_push_without_links_publishes_eval_results_with_names_not_paths(evaluated_run, tmp_path, run_cli):
    staged = tmp_path / "staged"
    code, lines, _ = run_cli(["push", evaluated_run, "--repo", "me/x", "--dry-run", staged])
    assert code == 0, lines
    published = {p.name: p.read_text() for p in (staged / "eval").glob("results.*")}
    assert set(published) == {"results.md", "results.json", "results.csv"}
    local = str(evaluated_run.parent)
    for name, text in published.items():
        assert local not in text, name  # no absolute path of this machine
    results = json.loads(published["results.json"])
    assert results["models"][0]["source"] == evaluated_run.name  # the run's name, as recipe.yaml gets it
    original = json.loads((evaluated_run / "eval" / "results.json").read_text())
    assert results["models"][0]["counting"] == original["models"][0]["counting"]  # the numbers untouched
    assert f"`{evaluated_run.name}`" in published["results.md"]
    assert not (staged / "eval" / atomic.MARKER).exists() and not (staged / "eval" / atomic.LOCK).exists()
