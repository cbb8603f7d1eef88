"""Reliability: what a kill, a bad name, a diverged step or a damaged file must never do to a run.

Arm names cannot reach outside DIR/arms; rmtree only removes folders retrofit marked; a damaged
checkpoint falls back to the previous one; no checkpoint is written from a non-finite step; the run
folder has one writer; the recovery curve and the logged loss survive a resume; floats like 3e-4 load.
Tiny counting GPT-2 runs (under a second each)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from retrofit import atomic
from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.experiment import driver as experiment
from retrofit.recipe import load_recipe, recipe_from_dict
from retrofit.train import checkpoint, loop, read_log, train, update
from tests.tiny import TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Killed(Exception):
    """Stands in for a kill at a chosen moment (the SIGKILL test in test_train covers the real thing)."""


def counting_recipe(out, steps=10, save_every=4, log_every=1, **train_keys) -> dict:
    return {"model": {"config": {"model_type": "gpt2", **TINY["gpt2"], "vocab_size": 16}},
            "data": {"task": "counting", "seq_len": 32},
            "train": {"steps": steps, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 2,
                      "progress": False, "log_every": log_every, **train_keys},
            "eval": {"batches": 1, "batch_size": 2},
            "output": {"dir": str(out), "save_every": save_every}}


def kill_at(event_name, at_step):
    def callback(event, step, info):
        if event == event_name and step == at_step:
            raise Killed(f"{event_name} {step}")
    return callback


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- arm names and rmtree ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["..", ".", "a/b", ".hidden", ""])
def test_an_unsafe_arm_name_is_refused_before_anything_is_created(name, tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("user data")
    out = tmp_path / "exp"
    arms = f'experiment.arms=[{{name: "{name}", patch: {{norm: softmax}}}}]'
    code = main(["experiment", str(experiment.DEMO_RECIPE), arms, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "arm name" in err and "\n" not in err, err
    assert not out.exists()
    assert (tmp_path / "precious.txt").read_text() == "user data"


@pytest.mark.parametrize("verb", ["experiment", "demo"])
@pytest.mark.parametrize("flag", [True, False])
def test_no_progress_turns_off_training_and_evaluation_bars(verb, flag, tmp_path, monkeypatch):
    import torch

    import retrofit.experiment as library
    from retrofit.commands import experiment as command
    seen = {}

    def fake_run(recipe, out, progress=True):
        seen.update(train=recipe.train.progress, eval=progress)
        return {}

    monkeypatch.setattr(library, "run_experiment", fake_run)  # imported by the command when it runs
    monkeypatch.setattr(command, "_print_summary", lambda results, out: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # demo's; the fixture's 1 thread stays
    argv = [verb, *([str(experiment.DEMO_RECIPE)] if verb == "experiment" else []), "--out", str(tmp_path / "x")]
    assert main(argv + (["--no-progress"] if flag else [])) == 0
    assert seen == {"train": not flag, "eval": not flag}


def test_run_arm_rechecks_a_name_changed_after_loading(tmp_path):
    recipe = load_recipe(experiment.DEMO_RECIPE)
    exp = recipe.section("experiment")
    arm = exp.arms[0]
    arm.name = ".."  # bypasses __post_init__
    (tmp_path / "exp" / "arms").mkdir(parents=True)
    (tmp_path / "exp" / "keep.txt").write_text("x")
    with pytest.raises(RetrofitError, match="arm name '..'"):
        experiment.run_arm(recipe, exp, arm, None, tmp_path / "exp")
    assert (tmp_path / "exp" / "keep.txt").is_file()


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


def test_an_arm_that_died_before_its_first_checkpoint_is_cleaned_only_if_ours(tmp_path, monkeypatch):
    recipe = load_recipe(experiment.DEMO_RECIPE, [
        "experiment.base_steps=0", "experiment.finetune_steps=3", "experiment.recovery_at=[0]",
        "train.batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=1", "train.progress=false",
        "eval.lengths=[64]", "eval.batches=1", "eval.batch_size=2", "output.save_every=2"])
    exp = recipe.section("experiment")
    arm = exp.arms[0]
    legacy = tmp_path / "arms" / arm.name  # an arm folder retrofit did not mark: the user's (issue 26, item 2)
    legacy.mkdir(parents=True)
    (legacy / "notes.txt").write_text("mine")
    with pytest.raises(RetrofitError, match="holds files retrofit did not write"):
        experiment.run_arm(recipe, exp, arm, None, tmp_path)
    assert [p.name for p in legacy.iterdir()] == ["notes.txt"] and (legacy / "notes.txt").read_text() == "mine"

    arm = exp.arms[1]
    arm_dir = tmp_path / "arms" / arm.name
    real_train = loop.train
    monkeypatch.setattr("retrofit.experiment.driver.train",
                        lambda *a, **k: real_train(*a, **k, callbacks=[kill_at("eval", 0)]))
    with pytest.raises(Killed):
        experiment.run_arm(recipe, exp, arm, None, tmp_path)
    assert (arm_dir / atomic.MARKER).is_file() and not (arm_dir / "checkpoints").exists()
    (arm_dir / "stale.txt").write_text("from the dead run")
    monkeypatch.undo()
    experiment.run_arm(recipe, exp, arm, None, tmp_path)
    assert not (arm_dir / "stale.txt").exists() and (arm_dir / "result.json").is_file()


# ---- failures, recovery curve, logged loss across a resume ---------------------------------------------------------

def test_any_exception_in_an_arm_is_a_one_line_failure_and_the_others_run(tmp_path, monkeypatch):
    real = experiment.run_arm

    def flaky(recipe, exp, arm, base, out):
        if arm.name == "softmax":
            raise ValueError("shapes do not match\nsecond line of detail")
        return real(recipe, exp, arm, base, out)

    monkeypatch.setattr(experiment, "run_arm", flaky)
    evaluated = []
    monkeypatch.setattr("retrofit.experiment.driver.evaluate_models",
                        lambda sources, spec: evaluated.extend(spec.names) or
                        {"models": [{"name": n, "counting": []} for n in spec.names], "lengths": spec.lengths})
    monkeypatch.setattr("retrofit.experiment.driver.write_report", lambda evaluation, out: None)
    monkeypatch.setattr("retrofit.experiment.driver.write_experiment_report", lambda results, out: None)
    results = experiment.run_experiment(experiment.DEMO_RECIPE, tmp_path, [
        "experiment.base_steps=0", "experiment.finetune_steps=2", "experiment.recovery_at=[0]",
        "experiment.arms=[{name: softmax, patch: {norm: softmax}}, {name: avnorm-rms, patch: {norm: avnorm}}]",
        "train.batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=1", "train.progress=false",
        "eval.lengths=[64]", "eval.batches=1", "eval.batch_size=2"], progress=False)
    assert results["arms"]["softmax"]["failed"] == "ValueError: shapes do not match"
    assert results["arms"]["avnorm-rms"]["recovery"] and not results["arms"]["avnorm-rms"]["failed"]
    assert evaluated == ["avnorm-rms"]


def test_the_recovery_curve_keeps_points_logged_before_the_resume_checkpoint(tmp_path, monkeypatch):
    recipe = load_recipe(experiment.DEMO_RECIPE, [
        "experiment.base_steps=0", "experiment.finetune_steps=6", "experiment.recovery_at=[0,2,4,6]",
        "train.batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=1", "train.progress=false",
        "eval.lengths=[64]", "eval.batches=1", "eval.batch_size=2", "output.save_every=2"])
    exp = recipe.section("experiment")
    arm = exp.arms[0]
    real_train = loop.train
    monkeypatch.setattr("retrofit.experiment.driver.train",
                        lambda *a, **k: real_train(*a, **k, callbacks=[kill_at("eval", 6)]))
    with pytest.raises(Killed):  # after the step-4 checkpoint, while evaluating step 6
        experiment.run_arm(recipe, exp, arm, None, tmp_path)
    monkeypatch.undo()
    first = experiment.recovery_points(tmp_path / "arms" / arm.name)
    recovery = experiment.run_arm(recipe, exp, arm, None, tmp_path)
    assert sorted(recovery) == [0, 2, 4, 6]
    assert all(recovery[s] == first[s] for s in (0, 2, 4))
    saved = json.loads((tmp_path / "arms" / arm.name / "recovery.json").read_text())
    assert sorted(int(s) for s in saved) == [0, 2, 4, 6]


def test_a_log_window_spanning_the_resume_logs_the_uninterrupted_mean(tmp_path):
    raw = counting_recipe(tmp_path / "full", steps=6, save_every=2, log_every=4)
    full = train(recipe_from_dict(raw))
    raw = counting_recipe(tmp_path / "run", steps=6, save_every=2, log_every=4)
    with pytest.raises(Killed):  # the checkpoint at 2 lies inside the window 1..4
        train(recipe_from_dict(raw), callbacks=[kill_at("checkpoint", 2)])
    resumed = train(recipe_from_dict(raw), resume=True)
    assert resumed.resumed_from == 2
    assert resumed.losses[4] == full.losses[4] and resumed.losses[6] == full.losses[6]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["final_loss"] == full.losses[6]


# ---- checkpoints: manifest and fall-back ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed_after_step_8(tmp_path_factory):
    """An uninterrupted 10-step run, and one killed at step 9 (checkpoints 4 and 8 on disk)."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.set_num_threads(1)
    full = train(recipe_from_dict(counting_recipe(root / "full")))
    with pytest.raises(Killed):
        train(recipe_from_dict(counting_recipe(root / "killed")), callbacks=[kill_at("step", 9)])
    assert [s for s, _ in checkpoint.complete_checkpoints(root / "killed")] == [4, 8]
    return weights(full.model), root / "killed"


def damage(folder: Path, what: str) -> str:
    """Damage one file of a checkpoint the way a disk or a kill would; returns the file's name."""
    name = {"rng": "random_states_0.pkl", "optimizer": "optimizer.bin", "model": "model.safetensors",
            "meta": "meta.json"}[what]
    path = folder / name
    if what == "rng":
        path.unlink()
    elif what == "optimizer":  # same size, one byte flipped
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif what == "model":  # truncated
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text("{")
    return name


@pytest.mark.parametrize("what", ["rng", "optimizer", "model", "meta"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(what, killed_after_step_8, tmp_path, capsys):
    reference, killed = killed_after_step_8
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    name = damage(run / "checkpoints" / "step-0000008", what)
    capsys.readouterr()
    resumed = train(recipe_from_dict(counting_recipe(run)), resume=True)
    out = capsys.readouterr().out
    assert f"step-0000008 is damaged: {name}" in out and "falling back to step-0000004" in out, out
    assert resumed.resumed_from == 4
    got = weights(resumed.model)
    assert all(torch.equal(got[k], reference[k]) for k in reference)  # steps 5..10 again, bitwise
    assert checkpoint.verify(run / "checkpoints" / "step-0000008") is None  # rewritten whole


def test_every_checkpoint_damaged_is_a_one_line_error(killed_after_step_8, tmp_path):
    _, killed = killed_after_step_8
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    damage(run / "checkpoints" / "step-0000008", "model")
    (run / "checkpoints" / "step-0000004" / checkpoint.MANIFEST).unlink()
    with pytest.raises(RetrofitError) as err:
        train(recipe_from_dict(counting_recipe(run)), resume=True)
    message = str(err.value)
    assert "no usable checkpoint" in message and "model.safetensors" in message
    assert "manifest.json is missing" in message
    assert "\n" not in message


# ---- divergence, lock, final save ----------------------------------------------------------------------------------

def test_a_non_finite_loss_on_a_save_step_writes_no_checkpoint(tmp_path, monkeypatch):
    real, calls = update.loss_sum, []

    def nan_at_step_5(model, part, task, *chunk_tokens):  # 2 micro-batches per step: calls 9 and 10 are step 5
        calls.append(1)
        loss = real(model, part, task, *chunk_tokens)
        return loss * float("nan") if len(calls) in (9, 10) else loss

    monkeypatch.setattr(update, "loss_sum", nan_at_step_5)
    run = tmp_path / "run"
    with pytest.raises(RetrofitError) as err:  # step 5 saves (save_every 5) but does not log (log_every 2)
        train(recipe_from_dict(counting_recipe(run, save_every=5, log_every=2)))
    assert "not finite" in str(err.value) and "at step 5" in str(err.value) and "\n" not in str(err.value)
    folder = run / checkpoint.FOLDER
    assert not any(folder.glob("*0000005")) and not (run / "result.json").exists()
    with atomic.folder_lock(run):  # the failed run let go of its lock
        pass


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    raw = counting_recipe(run, steps=2, save_every=0)
    with atomic.output_folder(run, "output.dir"), pytest.raises(RetrofitError) as err:  # as a running train holds it
        train(recipe_from_dict(raw), resume=True)
    assert f"in use by process {os.getpid()}" in str(err.value) and "\n" not in str(err.value)
    assert not (run / "log.jsonl").exists()
    assert train(recipe_from_dict(raw), resume=True).steps == 2  # released: the run goes ahead


def test_a_kill_while_saving_the_final_model_leaves_no_model_file(tmp_path, monkeypatch):
    real = loop.save_model

    def dies_after_writing(model, folder, **kwargs):
        real(model, folder, **kwargs)
        raise Killed("during the final save")

    monkeypatch.setattr(loop, "save_model", dies_after_writing)
    run = tmp_path / "run"
    with pytest.raises(Killed):
        train(recipe_from_dict(counting_recipe(run, steps=2, save_every=0)))
    assert not (run / "model.safetensors").exists() and not (run / "result.json").exists()
    monkeypatch.undo()
    train(recipe_from_dict(counting_recipe(run, steps=2, save_every=0)), resume=True)
    assert (run / "model.safetensors").is_file() and not (run / ".tmp-final").exists()


def test_atomic_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = atomic.atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


# ---- floats --------------------------------------------------------------------------------------------------------

BASE = {"model": {"source": "gpt2"}, "data": {"files": ["train.txt"]}}


def test_floats_without_a_dot_load_in_yaml_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE) + "train:\n  lr: 3e-4\n  adam_eps: 1e-8\n  betas: [9e-1, 0.95]\n")
    recipe = load_recipe(path)
    assert recipe.train.lr == 3e-4 and recipe.train.adam_eps == 1e-8 and recipe.train.betas == [0.9, 0.95]
    assert load_recipe(path, ["train.lr=5e-5"]).train.lr == 5e-5
    recipe = load_recipe(experiment.DEMO_RECIPE, ["experiment.finetune_lr=1e-3"])
    assert recipe.section("experiment").finetune_lr == 1e-3


@pytest.mark.parametrize("override, message", [
    ("train.lr=.inf", "train.lr must be >= 0 and finite, got inf"),
    ("train.lr=.nan", "train.lr must be >= 0 and finite, got nan"),
    ("train.lr=fast", "train.lr must be a number, got 'fast'"),
    ("train.steps=1e3", "train.steps must be an integer, got '1e3'"),
])
def test_non_numbers_and_infinite_rates_are_refused(override, message, tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(RetrofitError) as err:
        load_recipe(path, [override])
    assert str(err.value) == message


@pytest.mark.parametrize("override", ["experiment.finetune_lr=.inf", "experiment.finetune_lr=0",
                                      "experiment.arms=[{name: a, patch: {norm: softmax}, lr: .nan}]"])
def test_experiment_rates_must_be_finite_and_positive(override):
    with pytest.raises(RetrofitError, match="must be a finite number > 0"):
        load_recipe(experiment.DEMO_RECIPE, [override])


def test_read_log_keeps_the_last_line_per_step(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 2, "eval/l1@64": 1.0}\n{"step": 2, "eval/l1@64": 0.5}\n{"step": 3, "lo')
    assert read_log(log) == [{"step": 2, "eval/l1@64": 0.5}]
