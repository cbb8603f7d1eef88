"""A run's checkpoints under a kill, damage, a diverged step, a full disk or a second writer: a damaged
checkpoint falls back to the previous one; no checkpoint is written from a non-finite step; the run folder has one
writer; a full disk is one line and the run resumes; the logged loss survives a resume. Tiny counting GPT-2 runs
(under a second each); counting_recipe, Killed and kill_at serve other folders' run tests too."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from retrofit.errors import RetrofitError
from retrofit.io import atomic
from retrofit.load import save as model_saving
from retrofit.recipe import recipe_from_dict
from retrofit.train import read_log, resume_state, train, update
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


# ---- the logged loss across a resume ---------------------------------------------------------------------------------


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
    assert [s for s, _ in resume_state.complete_checkpoints(root / "killed")] == [4, 8]
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
    assert resume_state.verify(run / "checkpoints" / "step-0000008") is None  # rewritten whole


def test_every_checkpoint_damaged_is_a_one_line_error(killed_after_step_8, tmp_path):
    _, killed = killed_after_step_8
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    damage(run / "checkpoints" / "step-0000008", "model")
    (run / "checkpoints" / "step-0000004" / resume_state.MANIFEST).unlink()
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
    folder = run / resume_state.FOLDER
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
    assert not (run / atomic.LOCK).exists()  # a finished run keeps no .lock (issue 53)


def test_a_kill_while_saving_the_final_model_leaves_no_model_file(tmp_path, monkeypatch):
    real = model_saving._write_model  # what save_model writes into RUN/.tmp-final, before the renames

    def dies_after_writing(*args, **kwargs):
        real(*args, **kwargs)
        raise Killed("during the final save")

    monkeypatch.setattr(model_saving, "_write_model", dies_after_writing)
    run = tmp_path / "run"
    with pytest.raises(Killed):
        train(recipe_from_dict(counting_recipe(run, steps=2, save_every=0)))
    assert not (run / "model.safetensors").exists() and not (run / "result.json").exists()
    monkeypatch.undo()
    train(recipe_from_dict(counting_recipe(run, steps=2, save_every=0)), resume=True)
    assert (run / "model.safetensors").is_file() and not (run / ".tmp-final").exists()


# ---- the log, and a full disk while checkpointing --------------------------------------------------------------------


def test_read_log_keeps_the_last_line_per_step(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 2, "eval/l1@64": 1.0}\n{"step": 2, "eval/l1@64": 0.5}\n{"step": 3, "lo')
    assert read_log(log) == [{"step": 2, "eval/l1@64": 0.5}]


TORCH_WRITER_FULL = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                                 "data/0: file write failed")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    return weights(train(recipe_from_dict(counting_recipe(tmp_path_factory.mktemp("full") / "run"))).model)


@pytest.mark.parametrize("error", [TORCH_WRITER_FULL, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch-writer", "enospc"])
def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes(error, uninterrupted, tmp_path, monkeypatch):
    real_write = resume_state.write_state

    def full_at_step_8(accelerator, folder, sharded=None):
        real_write(accelerator, folder, sharded)  # files half there, as when the disk fills mid-write
        if folder.name.endswith("0000008"):
            raise error

    monkeypatch.setattr(resume_state, "write_state", full_at_step_8)
    run = tmp_path / "run"
    with pytest.raises(RetrofitError) as err:
        train(recipe_from_dict(counting_recipe(run)))
    message = str(err.value)
    assert "\n" not in message and message.startswith("the disk is full")  # torch's writer: "... or a file reached"
    assert "checkpoint step 8 could not be written" in message
    assert f"--resume {run}" in message
    assert [s for s, _ in resume_state.complete_checkpoints(run)] == [4]
    assert not list((run / resume_state.FOLDER).glob(".tmp-*"))  # its space is given back
    monkeypatch.setattr(resume_state, "write_state", real_write)
    resumed = train(recipe_from_dict(counting_recipe(run)), resume=True)
    assert resumed.resumed_from == 4
    for name, value in weights(resumed.model).items():
        assert torch.equal(value, uninterrupted[name]), name


def test_another_runtime_error_while_checkpointing_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(accelerator, folder, sharded=None):
        raise RuntimeError("a bug, not a disk")
    monkeypatch.setattr(resume_state, "write_state", broken)
    with pytest.raises(RuntimeError, match="a bug, not a disk"):
        train(recipe_from_dict(counting_recipe(tmp_path / "run")))


# ---- extending a run (issue 53) ------------------------------------------------------------------------------------

def test_raising_train_steps_extends_a_run_from_its_newest_checkpoint(tmp_path, capsys):
    """HF habit: a finished (or stopped) run continues when train.steps is raised. It restarts from the newest
    checkpoint (a run that writes checkpoints writes one after its last step too), with the data position and
    optimizer it saved; from there the learning rate follows the new total's schedule. Lowering train.steps, or any
    other change, is still refused."""
    from retrofit.train.schedules import lr_at
    raw = counting_recipe(tmp_path / "run", steps=6, save_every=4)
    first = train(recipe_from_dict(raw))
    assert [s for s, _ in resume_state.complete_checkpoints(tmp_path / "run")] == [4, 6]
    raw["train"]["steps"] = 10
    longer = recipe_from_dict(raw)
    extended = train(longer, resume=True)
    assert extended.resumed_from == 6 and extended.steps == 10
    out = capsys.readouterr().out
    assert "extending: train.steps 6 -> 10, from the checkpoint at step 6" in out, out
    log = {r["step"]: r for r in read_log(tmp_path / "run" / "log.jsonl") if "loss" in r}
    assert sorted(log) == list(range(1, 11)) and all(log[s]["loss"] == first.losses[s] for s in range(1, 7))
    assert all(log[s]["lr"] == pytest.approx(lr_at(s - 1, longer.train)) for s in range(7, 11))
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 10
    raw["train"]["steps"] = 8
    with pytest.raises(RetrofitError, match=r"train\.steps: 10 -> 8.*can only be raised"):
        train(recipe_from_dict(raw), resume=True)


def test_a_run_without_checkpoints_is_not_extended_from_step_zero(tmp_path):
    raw = counting_recipe(tmp_path / "run", steps=4, save_every=0)
    train(recipe_from_dict(raw))
    raw["train"]["steps"] = 6
    with pytest.raises(RetrofitError, match=r"has no checkpoint to extend it from .*output\.save_every"):
        train(recipe_from_dict(raw), resume=True)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 4  # the finished run untouched


def test_resume_dir_alone_reads_the_runs_recipe_and_takes_overrides(tmp_path, run_cli):
    """`retrofit train --resume DIR` said "name a recipe" although DIR holds recipe.yaml; overrides still apply."""
    import yaml
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(counting_recipe(tmp_path / "run", steps=4, save_every=2)))
    code, err, _ = run_cli(["train", tmp_path / "r.yaml"])
    assert code == 0, err
    code, err, out = run_cli(["train", "--resume", tmp_path / "run"])
    assert code == 0 and "already finished 4 steps" in out, err
    code, err, out = run_cli(["train", "--resume", tmp_path / "run", "train.steps=6"])
    assert code == 0 and "done: 6 steps" in out, err
    code, err, _ = run_cli(["train", "--resume", tmp_path / "nothing"])
    assert code == 2 and len(err) == 1 and "recipe.yaml" in err[0], err
