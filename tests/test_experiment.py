"""The experiment end to end: `retrofit demo` shrunk by overrides, stage skipping, failed arms, recipes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retrofit import experiment
from retrofit.errors import RetrofitError
from retrofit.recipe import load_recipe
from retrofit.report import validate

SHRINK = ["experiment.base_steps=6", "experiment.finetune_steps=4", "experiment.recovery_at=[0,2]",
          "eval.lengths=[64,128]", "eval.batches=1", "eval.batch_size=4", "train.batch_size=8",
          "train.micro_batch_size=8", "train.warmup_steps=2", "train.log_every=2", "train.progress=false"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    run = subprocess.run([sys.executable, "-m", "retrofit", "demo", *SHRINK, "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


def test_demo_writes_the_report(demo_run):
    out, stdout = demo_run
    arms = [a.name for a in load_recipe(experiment.DEMO_RECIPE).section("experiment").arms]
    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == set(arms)
    assert all(not a["failed"] for a in results["arms"].values())
    names = [m["name"] for m in results["evaluation"]["models"]]
    assert names == ["base"] + arms
    for m in results["evaluation"]["models"]:
        assert [r["length"] for r in m["counting"]] == [64, 128]
    validate(results["evaluation"])
    for arm in results["arms"].values():  # the recovery curve: evaluated at 0, 2 and the last step
        assert sorted(int(s) for s in arm["recovery"]) == [0, 2, 4]
    report = (out / "report.md").read_text()
    for name in ["base"] + arms:
        assert f"| {name} |" in report
    assert "64*" in report and "recovery.png" in report and (out / "recovery.png").is_file()
    assert (out / "eval" / "counting.png").is_file()
    assert "Hardware" in report and "Wall time" in report
    assert f"report: {out / 'report.md'}" in stdout and "| base |" in stdout  # the terminal summary


def test_rerun_skips_finished_stages(demo_run):
    out, _ = demo_run
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/result.json")} | \
             {p: p.stat().st_mtime_ns for p in out.glob("arms/*/result.json")}
    results = experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK, progress=False)
    after = {p: p.stat().st_mtime_ns for p in before}
    assert before == after  # nothing retrained
    assert results["arms"]["softmax"]["recovery"]


def test_a_failing_arm_is_reported_and_the_others_run(tmp_path, monkeypatch):
    real = experiment.run_arm

    def flaky(recipe, exp, arm, base, out):
        if arm.name == "ssmax":
            raise RetrofitError("the training loss is nan at step 3; lower train.lr or check the data")
        return real(recipe, exp, arm, base, out)

    monkeypatch.setattr(experiment, "run_arm", flaky)
    overrides = SHRINK + ["eval.lengths=[64]"]
    results = experiment.run_experiment(experiment.DEMO_RECIPE, tmp_path, overrides, progress=False)
    assert "nan" in results["arms"]["ssmax"]["failed"]
    assert "ssmax" not in [m["name"] for m in results["evaluation"]["models"]]
    assert results["arms"]["softmax1"]["recovery"]
    assert '"ssmax"' in (tmp_path / "report.md").read_text()


def test_the_issue_recipes_ship_with_experiment_sections():
    folder = Path(experiment.__file__).parent / "recipes"
    for name in ("demo", "counting-psoftmax", "gpt2-avnorm-retrofit", "llama-avnorm-retrofit", "nope",
                 "norm-comparison"):
        assert load_recipe(folder / f"{name}.yaml").section("experiment").arms, name
    assert (Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml").is_file()  # recipes/ links there


def test_experiment_without_section_is_refused(tmp_path):
    recipe = Path(experiment.__file__).parent / "recipes" / "train-tiny-counting.yaml"
    with pytest.raises(RetrofitError, match="no experiment section"):
        experiment.run_experiment(recipe, tmp_path)


@pytest.mark.parametrize("override,match", [
    ("experiment.arms=[]", "experiment.arms is empty"),
    ("experiment.finetune_steps=0", "finetune_steps >= 1"),
    ("experiment.armz=[]", "did you mean 'arms'"),
])
def test_bad_experiment_section(override, match):
    with pytest.raises(RetrofitError, match=match):
        load_recipe(experiment.DEMO_RECIPE, [override])
