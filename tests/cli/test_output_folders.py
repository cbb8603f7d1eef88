"""Output folders: nothing of the user's overwritten (issue 26, items 2, 8 and the low items on files).

Every verb that writes a folder takes it only when it is new, empty or made by retrofit
(retrofit.io.atomic.check_output), and a refusal leaves the user's folder byte for byte as it was; rmtree removes
only folders retrofit marked; `~` is expanded once; a killed save's temporary folder is recognised and cleaned; a
refused train leaves no folder; a second `eval --out X` is refused while the first holds X. (push and symbolic
links: tests/hub/test_push_links.py.) Tiny models built in-process; no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.io import atomic
from tests.tiny import TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NOT_OURS = ("retrofit {verb}: error: {flag} {path} holds files retrofit did not write (it has no .retrofit-owned); "
            "choose a new or empty folder: retrofit never writes into a folder of yours (a run from an older retrofit: "
            "`retrofit adopt {path}` first)")
NOT_EMPTY = "retrofit {verb}: error: {flag} {path} exists and is not empty; choose another {flag} or remove it"


def checksums(root: Path) -> dict:
    """Every path under root (links not followed): kind, mode and the sha256 of a file's bytes."""
    sums = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
        sums[p.relative_to(root).as_posix()] = (p.is_dir(), p.is_symlink(), st.st_mode, digest)
    return sums


def make_canary(root: Path) -> Path:
    """A folder of the user's own files, named like a run's: what item 2 found deleted and overwritten."""
    canary = root / "mine"
    (canary / "adapter").mkdir(parents=True)
    (canary / "adapter" / "adapter_config.json").write_text('{"r": 8, "mine": true}')
    (canary / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(256))
    (canary / "recipe.yaml").write_text("my: own notes\n")
    (canary / "model.safetensors").write_bytes(os.urandom(512))
    (canary / "tokenizer.json").write_text('{"mine": true}')
    return canary


def counting_run(root: Path, name: str = "run", **output) -> tuple[Path, dict]:
    """A finished tiny counting GPT-2 run (a second or two) and its recipe."""
    recipe = {"model": {"config": {"model_type": "gpt2", **TINY["gpt2"], "vocab_size": 16}},
              "patch": {"norm": "ssmax"},  # a retrofit checkpoint: push takes it
              "data": {"task": "counting", "seq_len": 32},
              "train": {"steps": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 1,
                        "progress": False, "log_every": 1},
              "eval": {"batches": 1, "batch_size": 2},
              "output": {"dir": str(root / name), "save_every": 0, **output}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 0
    return root / name, recipe


# ---- item 2: a folder of the user's own files, for every verb -----------------------------------------------------

VERBS = [  # (id, argv with placeholders, flag named in the message, message template)
    ("train-out", "train {recipe} --out {canary}", "--out", NOT_OURS),
    ("train-output-dir", "train {recipe} output.dir={canary}", "output.dir", NOT_OURS),
    ("train-resume", "train {recipe} --resume {canary}", "--resume", NOT_OURS),
    ("experiment", "demo --out {canary}", "--out", NOT_OURS),
    ("patch", "patch {model} --norm avnorm --out {canary}", "--out", NOT_EMPTY),
    ("eval", "eval {model} --data {text} --lengths 8 --out {canary}", "--out", NOT_OURS),
    ("diagnose", "diagnose {model} --data {text} --lengths 8,16 --out {canary}", "--out", NOT_OURS),
    ("push-dry-run", "push {ckpt} --repo me/x --dry-run {canary}", "--dry-run", NOT_EMPTY),
]


@pytest.mark.parametrize("case_id,template,flag,message", VERBS, ids=[v[0] for v in VERBS])
def test_no_verb_writes_into_a_folder_of_the_users_files(case_id, template, flag, message, world, tmp_path, run_cli):
    canary = make_canary(tmp_path)
    before = checksums(tmp_path)
    code, lines, _ = run_cli(template.format(**world, canary=canary).split())
    verb = "demo" if case_id == "experiment" else template.split()[0]
    assert code == 2 and lines == [message.format(verb=verb, flag=flag, path=canary)], lines
    assert checksums(tmp_path) == before  # not a byte, mode or name changed; nothing added next to it


@pytest.mark.parametrize("value", ["/", "~/"])  # (a bare ~ is YAML's null)
def test_the_root_and_the_home_folder_are_refused(value, world, tmp_path, monkeypatch, run_cli):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export PS1=mine\n")
    monkeypatch.setenv("HOME", str(home))
    before = checksums(tmp_path)
    code, lines, _ = run_cli(["train", world["recipe"], f"output.dir={value}"])
    shown = "/" if value == "/" else str(home)  # `~` is expanded once, before anything else sees it
    assert code == 2 and lines == [NOT_OURS.format(verb="train", flag="output.dir", path=shown)], lines
    assert checksums(tmp_path) == before


def test_a_retrofit_made_run_resumes_and_an_empty_folder_is_taken(tmp_path, run_cli):
    run, recipe = counting_run(tmp_path)
    assert (run / atomic.MARKER).is_file()  # train marks the folder it made
    code, lines, out = run_cli(["train", tmp_path / "run.yaml", "--resume", run])
    assert code == 0 and "already finished 2 steps" in out, lines
    empty = tmp_path / "empty"
    empty.mkdir()
    code, lines, _ = run_cli(["train", tmp_path / "run.yaml", "--out", empty])
    assert code == 0 and (empty / "result.json").is_file() and (empty / atomic.MARKER).is_file(), lines


@pytest.mark.parametrize("name", ["run #2", "null", "yes", "007"])
def test_out_and_resume_name_the_folder_as_typed_never_read_as_yaml(name, tmp_path, monkeypatch, run_cli):
    """`--out "run #2"` trained into `run` and `--out null` into the recipe's own output.dir: both flags were handed
    back to the YAML override parser (`#` starts a comment; null, yes and 007 are not text there). The folder is the
    one named, and --resume finds it by the same name."""
    monkeypatch.chdir(tmp_path)
    _, recipe = counting_run(tmp_path, "default")  # the recipe's own output.dir: tmp_path/default, trained once
    before = sorted(p.name for p in tmp_path.iterdir())
    code, lines, _ = run_cli(["train", "default.yaml", "--out", name])
    assert code == 0 and (tmp_path / name / "result.json").is_file(), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, name])  # nothing else was made
    code, lines, out = run_cli(["train", "default.yaml", "--resume", name])
    assert code == 0 and f"{name} already finished 2 steps" in out, lines


def test_a_run_from_before_the_marker_resumes_once_its_user_adopts_it(tmp_path, run_cli):
    """Only the marker makes a folder retrofit's (issue 36): a run an older retrofit wrote is refused, however
    retrofit-like its log.jsonl, until `retrofit adopt RUN` lists it and marks it."""
    run, _ = counting_run(tmp_path, save_every=1)
    (run / atomic.MARKER).unlink()  # as an older retrofit left it: its log.jsonl opens with the config event
    (run / "result.json").unlink()
    before = checksums(tmp_path)
    code, lines, _ = run_cli(["train", tmp_path / "run.yaml", "--resume", run])
    assert code == 2 and "holds files retrofit did not write" in lines[-1] and f"retrofit adopt {run}" in lines[-1]
    assert checksums(tmp_path) == before
    code, lines, out = run_cli(["adopt", run])
    assert code == 0 and "  log.jsonl  (" in out and (run / atomic.MARKER).is_file(), lines
    code, lines, out = run_cli(["train", tmp_path / "run.yaml", "--resume", run])
    assert code == 0 and "resumed from" in out, lines
    assert (run / "result.json").is_file() and (run / atomic.MARKER).is_file()


def test_a_copied_retrofit_results_file_does_not_make_a_folder_retrofits(tmp_path):
    """9f7e963 took a folder holding a results.json with a `retrofit.` schema as its own and wrote into it."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "results.json").write_text(json.dumps({"schema": "retrofit.eval/1"}))
    (notes / "mine.md").write_text("mine")
    with pytest.raises(atomic.RetrofitError, match="holds files retrofit did not write"):
        atomic.check_output(notes, "--out")
    folder, listing = atomic.adopt(notes)  # the user's choice, not an inference
    assert folder == notes and [name for name, _ in listing] == ["mine.md", "results.json"]
    assert atomic.check_output(notes, "--out") == notes
    with pytest.raises(atomic.RetrofitError, match="retrofit's already"):
        atomic.adopt(notes)


def test_an_experiment_re_run_keeps_working(tmp_path, run_cli):
    overrides = ["experiment.base_steps=0", "experiment.finetune_steps=1", "experiment.recovery_at=[0]",
                 "experiment.arms=[{name: softmax, patch: {norm: softmax}}]", "train.batch_size=2",
                 "train.micro_batch_size=2", "train.warmup_steps=1", "train.progress=false", "eval.lengths=[64]",
                 "eval.batches=1", "eval.batch_size=2"]
    out = tmp_path / "exp"
    code, lines, _ = run_cli(["demo", *overrides, "--out", out])
    assert code == 0 and (out / atomic.MARKER).is_file(), lines
    code, lines, printed = run_cli(["demo", *overrides, "--out", out])
    assert code == 0 and "finished, skipping" in printed, lines


# ---- item 8: `~` ----------------------------------------------------------------------------------------------------

def test_tilde_is_expanded_once_and_no_literal_tilde_folder_appears(world, tmp_path, monkeypatch, run_cli):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    run, _ = counting_run(tmp_path)  # something to eval and push
    steps = [(["train", tmp_path / "run.yaml", "--out", "~/t"], home / "t" / "result.json", f"model in {home}/t"),
             (["train", tmp_path / "run.yaml", "output.dir=~/r"], home / "r" / "result.json", f"model in {home}/r"),
             (["eval", run, "--lengths", "32", "--trials", "2", "--no-progress", "--out", "~/e"],
              home / "e" / "results.json", f"{home}/e/results.json"),
             (["patch", world["model"], "--norm", "avnorm", "--out", "~/p"], home / "p" / "config.json",
              f"saved to {home}/p"),
             (["push", run, "--repo", "me/x", "--dry-run", "~/s"], home / "s" / "README.md", f"wrote {home}/s")]
    for argv, written, hint in steps:
        code, lines, out = run_cli(argv)
        assert code == 0 and written.is_file(), (argv, lines)
        assert hint in out, (argv, out)  # what is printed is where it was written
    assert list(cwd.iterdir()) == []  # no ./~ folder, nothing else in the working folder


# ---- low items -------------------------------------------------------------------------------------------------------

HOLD_SAVE = """
import sys, time
from retrofit.io.atomic import atomic_folder
with atomic_folder(sys.argv[1], "--out") as tmp:
    (tmp / "model.safetensors").write_bytes(b"half-written")
    print(tmp, flush=True)
    time.sleep(120)
"""


def _saving(out: Path) -> tuple[subprocess.Popen, Path]:
    """A process inside atomic_folder(out), mid-save; returns it and its temporary folder."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_SAVE, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    return proc, Path(proc.stdout.readline().strip())


def test_a_save_killed_mid_way_leaves_a_marked_folder_the_next_save_removes(world, tmp_path, run_cli):
    out = tmp_path / "out"
    proc, tmp = _saving(out)
    try:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.")
        assert atomic.clean_abandoned(out) == [] and tmp.is_dir()  # alive: its lock is held, it is kept
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp / atomic.MARKER).is_file() and (tmp / "model.safetensors").is_file()  # what SIGKILL leaves
    mine = tmp_path / ".out.user-backup"  # the user's own folder with a matching name: never touched
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, lines, _ = run_cli(["patch", world["model"], "--norm", "avnorm", "--out", out])
    assert code == 0, lines
    assert not tmp.exists() and (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.user-backup", "out"]
    assert not (out / atomic.MARKER).exists() and not (out / atomic.LOCK).exists()  # the model folder is clean


def test_a_train_refused_for_its_length_leaves_no_folder(tmp_path, run_cli):
    recipe = tmp_path / "long.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": {"model_type": "gpt2", **TINY["gpt2"], "vocab_size": 16}},  # 64 learned positions
        "data": {"task": "counting", "seq_len": 128},
        "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "progress": False},
        "eval": {"batches": 1, "batch_size": 2}}))
    out = tmp_path / "runs" / "long"
    code, lines, _ = run_cli(["train", recipe, "--out", out])
    assert code == 2 and lines == ["retrofit train: error: length 128 (data.seq_len / eval.lengths) exceeds gpt2's 64 "
                                   "learned positions; set patch.nope: true (with a patch.norm) or use shorter "
                                   "lengths"], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.yaml"]  # neither runs/long nor runs/
    empty = tmp_path / "empty"  # a folder the user made empty stays empty: no marker, no lock left in it
    empty.mkdir()
    code, lines, _ = run_cli(["train", recipe, "--out", empty])
    assert code == 2 and list(empty.iterdir()) == [], lines


def test_a_second_eval_into_the_same_folder_is_refused_while_the_first_runs(evaluated_run, tmp_path, run_cli):
    out = tmp_path / "eval"
    argv = ["eval", evaluated_run, "--lengths", "32", "--trials", "2", "--no-progress", "--out", out]
    with atomic.output_folder(out, "--out"):  # the first `eval --out X`, still running
        code, lines, _ = run_cli(argv)
        assert code == 2 and lines == [f"retrofit eval: error: {out} is in use by process {os.getpid()} "
                                       f"(lock {out / atomic.LOCK}); wait for it to finish, or stop it, and try again"]
        assert sorted(p.name for p in out.iterdir()) == sorted([atomic.MARKER, atomic.LOCK])  # the second wrote nothing
    code, lines, _ = run_cli(argv)  # once it is done, the folder (made by retrofit) is written again
    assert code == 0 and (out / "results.json").is_file(), lines


def test_a_released_lock_leaves_no_file_and_a_lock_on_a_removed_file_is_refused(tmp_path, monkeypatch):
    """The lock file goes with its holder (it stayed in every finished run); one who opened the file just before the
    holder removed it must not hold a lock on a name nobody else sees: refused, in one line, to try again."""
    import fcntl
    with atomic.folder_lock(tmp_path) as path:
        late = open(path, "a+")  # a second process's open, racing the first's release
    assert not path.exists()
    fcntl.flock(late.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the flock: of an unlinked file
    late.close()
    with atomic.folder_lock(tmp_path):
        assert path.is_file()
    monkeypatch.setattr(atomic.os, "fstat", lambda fd: os.stat_result((0,) * 10))  # the file locked is not the one
    with pytest.raises(RetrofitError, match=r"is in use .* try again"), atomic.folder_lock(tmp_path):  # at the path
        pass


def test_remove_owned_needs_the_marker_and_a_folder_strictly_inside(tmp_path):
    root = tmp_path / "run"
    plain = root / "plain"
    plain.mkdir(parents=True)
    assert not atomic.remove_owned(plain, root) and plain.is_dir()  # no marker: not ours
    atomic.owned_folder(root)
    assert not atomic.remove_owned(root, root) and root.is_dir()  # the root itself, even marked
    outside = atomic.owned_folder(tmp_path / "elsewhere")
    assert not atomic.remove_owned(outside, root) and outside.is_dir()  # marked but outside
    assert not atomic.remove_owned(root / "sub" / ".." / "..", root)  # a path that climbs out
    link = root / "link"
    link.symlink_to(outside)
    assert not atomic.remove_owned(link, root) and outside.is_dir()
    mine = atomic.owned_folder(root / "mine")
    assert atomic.remove_owned(mine, root) and not mine.exists()


def test_atomic_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = atomic.atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
