"""An experiment's arms: a name cannot reach outside DIR/arms, an arm that died or raised is cleaned or reported in
one line while the others run, the recovery curve survives a resume, an edited arm is trained again and a changed
base refused, and tables label an arm from its checkpoint. Tiny counting runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.experiment import driver as experiment
from retrofit.experiment.driver import DEMO_RECIPE, run_experiment
from retrofit.io import atomic
from retrofit.io.atomic import MARKER
from retrofit.recipe import load_recipe
from retrofit.train import loop
from tests.train.test_checkpoints import Killed, kill_at

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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


def test_any_exception_in_an_arm_is_a_one_line_failure_and_the_others_run(tmp_path, monkeypatch):
    real = experiment.run_arm

    def flaky(recipe, exp, arm, base, out):
        if arm.name == "softmax":
            raise ValueError("shapes do not match\nsecond line of detail")
        return real(recipe, exp, arm, base, out)

    monkeypatch.setattr(experiment, "run_arm", flaky)
    evaluated = []
    monkeypatch.setattr("retrofit.experiment.results.evaluate_models",
                        lambda sources, spec: evaluated.extend(spec.names) or
                        {"models": [{"name": n, "counting": []} for n in spec.names], "lengths": spec.lengths})
    monkeypatch.setattr("retrofit.experiment.driver.write_report", lambda evaluation, out: None)
    monkeypatch.setattr("retrofit.experiment.results.write_experiment_report", lambda results, out: None)
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


EXPERIMENT = ["experiment.base_steps=4", "experiment.finetune_steps=3", "experiment.recovery_at=[0]",
              "eval.lengths=[64]", "eval.batches=1", "eval.batch_size=4", "train.batch_size=4",
              "train.micro_batch_size=4", "train.warmup_steps=1", "train.log_every=3", "train.progress=false"]


def _arms(psoftmax: str) -> str:
    return ('experiment.arms=[{"name": "softmax", "patch": {"norm": "softmax"}}, '
            f'{{"name": "psoftmax", "patch": {{"norm": "psoftmax", {psoftmax}}}}}]')


def _finished_at(out, arm):
    return (out / "arms" / arm / "result.json").stat().st_mtime_ns


@pytest.fixture(scope="module")
def experiment_p2(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "run"
    torch.set_num_threads(1)
    run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 2.0')], progress=False)
    return out


def test_an_edited_arm_is_trained_again_and_reported_with_its_new_settings(experiment_p2, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)  # a moved DIR: the arms still match their base by its place in DIR
    softmax, psoftmax = _finished_at(out, "softmax"), _finished_at(out, "psoftmax")
    capsys.readouterr()
    results = run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 3.0')], progress=False)
    printed = capsys.readouterr().out
    assert "arm psoftmax: its settings changed (patch.p: 2.0 -> 3.0); training it again" in printed
    assert _finished_at(out, "softmax") == softmax and _finished_at(out, "psoftmax") != psoftmax
    assert json.loads((out / "arms" / "psoftmax" / "config.json").read_text())["retrofit"]["options"]["p"] == 3.0
    assert results["arms"]["psoftmax"]["patch"]["p"] == 3.0 and not results["arms"]["psoftmax"]["failed"]
    assert "| psoftmax | p=3.0, norm=psoftmax |" in (out / "report.md").read_text()
    evaluated = {m["name"]: m["retrofit"] for m in results["evaluation"]["models"]}
    assert evaluated["psoftmax"]["options"]["p"] == 3.0  # evaluated again, not the p=2 results reused


def test_an_edited_arm_not_made_by_retrofit_is_refused_naming_the_change(experiment_p2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)
    (out / "arms" / "psoftmax" / MARKER).unlink()  # e.g. a folder the user put there
    before = {p: p.stat().st_mtime_ns for p in (out / "arms" / "psoftmax").rglob("*")}
    results = run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 3.0')], progress=False)
    assert results["arms"]["psoftmax"]["failed"].startswith(
        f"arm psoftmax: {out / 'arms' / 'psoftmax'} was trained with other settings (patch.p: 2.0 -> 3.0)")
    assert {p: p.stat().st_mtime_ns for p in (out / "arms" / "psoftmax").rglob("*")} == before


@pytest.mark.parametrize("change, named", [
    ("experiment.base_steps=5", "train.steps: 4 -> 5"),
    ('experiment.base_patch={"norm": "softmax", "nope": true}', "patch.nope: False -> True"),
])
def test_a_changed_base_is_refused_not_reused_under_its_arms(experiment_p2, tmp_path, change, named):
    """Every arm starts from the base, so a base trained with other settings is a new experiment: refused in one
    line naming the change, and nothing in DIR is touched."""
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(RetrofitError) as err:
        run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 2.0'), change], progress=False)
    assert str(err.value).startswith(f"{out / 'base'} was trained with other settings (") and named in str(err.value)
    assert "\n" not in str(err.value) and "pass a new --out" in str(err.value)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_tables_label_an_arm_from_its_checkpoint(tmp_path):
    """A psoftmax arm whose schedule ends at p=1.5 was trained (and is saved) as p=1.5: so it is labelled."""
    arm = ('experiment.arms=[{"name": "psoftmax", "patch": {"norm": "psoftmax", "p": 2.0, "gain": 1.0}, '
           '"recovery": {"schedule": {"steps": 2, "end": 1.5}, "calibrate": 0}}]')
    results = run_experiment(DEMO_RECIPE, tmp_path / "run", [*EXPERIMENT, arm], progress=False)
    assert results["arms"]["psoftmax"]["patch"]["p"] == 1.5  # the recipe says 2.0
    rows = [line for line in (tmp_path / "run" / "report.md").read_text().splitlines()
            if line.startswith("| psoftmax | ") and "norm=psoftmax" in line]
    assert rows and all("p=1.5" in row and "p=2.0" not in row for row in rows), rows


def _scratch_recipe(**experiment_extra):
    from retrofit.recipe import recipe_from_dict

    return recipe_from_dict({
        "model": {"config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "vocab_size": 16}, "zero_init": ["mlp_output"]},
        "data": {"task": "counting", "seq_len": 16}, "train": {"steps": 1},
        "experiment": {"finetune_steps": 2, "arms": [
            {"name": "both", "patch": {"norm": "softmax", "gate": "head:0.5:12"}},
            {"name": "gate-only", "patch": {"norm": "softmax", "gate": "head:0.5:12"}, "zero_init": []},
            {"name": "attention-zero", "patch": {"norm": "softmax"}, "zero_init": ["attention_output"]}],
            **experiment_extra}})


def test_an_arm_sets_its_own_zero_init_for_the_ablation(tmp_path, monkeypatch):
    """Issue 55's ablation: arms of one from-scratch experiment differ in model.zero_init (and the gate)."""
    recipe = _scratch_recipe()
    exp, seen = recipe.section("experiment"), {}

    class Stop(Exception):
        pass

    def fake_train(stage, **kwargs):
        seen[stage.output.dir] = (stage.model.zero_init, stage.patch.spec().gate)
        raise Stop

    monkeypatch.setattr(experiment, "train", fake_train)
    for arm in exp.arms:
        with pytest.raises(Stop):
            experiment.run_arm(recipe, exp, arm, None, tmp_path / "exp")
    gate = {"kind": "head", "start": 0.5, "inputs": 12}
    assert {k.rsplit("/", 1)[-1]: v for k, v in seen.items()} == {
        "both": (["mlp_output"], gate), "gate-only": ([], gate), "attention-zero": (["attention_output"], None)}


def test_an_arm_zero_init_needs_a_model_built_from_its_config():
    with pytest.raises(RetrofitError, match="experiment arm attention-zero sets zero_init.*drop the arm's zero_init"):
        _scratch_recipe(base_steps=5)
    from retrofit.recipe import recipe_from_dict
    with pytest.raises(RetrofitError, match="experiment arm x zero_init: unknown part 'mlp'"):
        recipe_from_dict({"model": {"config": {"model_type": "llama"}}, "data": {"task": "counting"},
                          "experiment": {"arms": [{"name": "x", "zero_init": ["mlp"]}]}})
