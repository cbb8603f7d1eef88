"""The experiment end to end: `retrofit demo` shrunk by overrides, stage skipping, failed arms, recipes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError
from retrofit.evaluate.report import validate
from retrofit.experiment import driver as experiment
from retrofit.recipe import load_recipe

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
    l1 = results["evaluation"]["models"][0]["counting"][0]
    assert f"{l1['l1']:.3f} ± {(l1['ci95'][1] - l1['ci95'][0]) / 2:.3f}" in report  # the interval over sequences
    assert "64*" in report and "recovery.png" in report and (out / "recovery.png").is_file()
    assert (out / "eval" / "counting.png").is_file()
    assert "Hardware" in report and "Wall time" in report
    table = report.split("### Training vs evaluation at the trained length (64)")[1]  # overfitting shows here
    for name, arm in results["arms"].items():
        assert arm["train_loss"] == json.loads((out / "arms" / name / "result.json").read_text())["final_loss"]
        at = next(r["l1"] for m in results["evaluation"]["models"] if m["name"] == name for r in m["counting"]
                  if r["length"] == 64)
        assert f"| {name} | {arm['train_loss']:.3f} | {at:.3f} | {at - arm['train_loss']:+.3f} |" in table
    assert f"report: {out / 'report.md'}" in stdout and "| base |" in stdout  # the terminal summary


def test_a_calibrated_arm_is_labelled_calibrated_not_with_its_initial_gain(demo_run):
    """report.md showed `gain=1.0` for the calibrated AVNorm arm: the option's start value, not what was trained."""
    results = json.loads((demo_run[0] / "results.json").read_text())
    patch = results["arms"]["avnorm-rms"]["patch"]
    record = json.loads((demo_run[0] / "arms" / "avnorm-rms" / "config.json").read_text())["retrofit"]
    assert patch["gain"] == f"calibrated on {record['calibration']['tokens']} tokens"
    assert "gain=1.0" not in (demo_run[0] / "report.md").read_text()


def test_the_demo_is_deterministic_at_a_given_thread_count(demo_run, tmp_path):
    """docs/results/demo.md's claim, as it now reads: the same thread count (recorded with the library versions in
    results.json) prints the same numbers. A second run at this test's thread count."""
    out = tmp_path / "again"
    run = subprocess.run([sys.executable, "-m", "retrofit", "demo", *SHRINK, "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads((d / "results.json").read_text()) for d in (demo_run[0], out))
    assert first["hardware"]["threads"] == second["hardware"]["threads"]
    assert {"torch", "transformers"} <= set(first["hardware"])
    assert [m["counting"] for m in first["evaluation"]["models"]] == \
        [m["counting"] for m in second["evaluation"]["models"]]
    assert {n: a["train_loss"] for n, a in first["arms"].items()} == \
        {n: a["train_loss"] for n, a in second["arms"].items()}


def test_the_demo_takes_its_threads_from_omp_num_threads(monkeypatch, tmp_path):
    """`retrofit demo` set torch's threads to the core count over OMP_NUM_THREADS (issue 53): a shared machine's
    OMP_NUM_THREADS=1 is kept; without it the demo uses every core, as before."""
    import torch

    from retrofit.cli import main
    seen = []
    monkeypatch.setattr("retrofit.experiment.run_experiment", lambda *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.setattr("retrofit.commands.experiment._print_summary", lambda *a: None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert main(["demo", "--out", str(tmp_path / "a")]) == 0
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert main(["demo", "--out", str(tmp_path / "b")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, max(1, os.cpu_count() or 1)]


def test_the_report_says_what_each_run_trained_from(demo_run, tmp_path):
    """From a base, or from scratch with seeds and arms' own rates: the first line and the recovery section say
    which, from the results themselves (a from-scratch report once said every arm was finetuned from a base)."""
    from retrofit.experiment.report import write_experiment_report
    results = json.loads((demo_run[0] / "results.json").read_text())
    report = (demo_run[0] / "report.md").read_text()
    assert "Base checkpoint, then every arm finetuned from it" in report and "arm \\ finetune step" in report
    assert "during finetuning" in report and "own learning rate" not in report
    first = next(iter(results["arms"]))
    results["arms"][first]["settings"]["lr"] = 0.004
    scratch = dict(results, base=None, seeds=[0, 1])
    (tmp_path / "eval").mkdir()
    text = write_experiment_report(scratch, tmp_path).read_text()
    assert "Every arm trained from scratch" in text and "Base checkpoint" not in text
    assert "once under each training seed [0, 1]" in text and f"own learning rate: {first} 0.004 (the others" in text
    assert "arm \\ training step" in text and "during training (from scratch)" in text and "finetun" not in text


def _count_evaluations(monkeypatch, fail_on=None) -> list:
    """Replace evaluate_models with a wrapper that records model names (and can fail on one)."""
    import retrofit.evaluate
    real, seen = retrofit.evaluate.evaluate_models, []

    def counted(sources, spec):
        seen.extend(spec.names)
        if fail_on in spec.names:
            raise RetrofitError(f"out of memory at the longest length ({fail_on})")
        return real(sources, spec)

    monkeypatch.setattr("retrofit.experiment.results.evaluate_models", counted)
    return seen


def test_rerun_skips_finished_stages(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)  # copy2 keeps the checkpoints' times
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/result.json")} | \
             {p: p.stat().st_mtime_ns for p in out.glob("arms/*/result.json")}
    evaluated = _count_evaluations(monkeypatch)
    results = experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK, progress=False)
    after = {p: p.stat().st_mtime_ns for p in before}
    assert before == after  # nothing retrained
    assert evaluated == []  # nor evaluated again
    assert results["arms"]["softmax"]["recovery"]
    first = json.loads((demo_run[0] / "results.json").read_text())
    models = first["evaluation"]["models"]
    assert [m["counting"] for m in results["evaluation"]["models"]] == [m["counting"] for m in models]
    assert results["wall_time_s"] == first["wall_time_s"]  # the skipped stages keep their recorded times
    assert all(m["eval_s"] > 0 for m in models)


def test_a_retrained_arm_is_evaluated_again(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)
    finished = out / "arms" / "ssmax" / "result.json"
    os.utime(finished, (time.time() + 60, time.time() + 60))  # finished after its evaluation
    evaluated = _count_evaluations(monkeypatch)
    experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK, progress=False)
    assert evaluated == ["ssmax"]


def test_a_crash_during_evaluation_keeps_the_models_already_done(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)
    shutil.rmtree(out / "eval")
    evaluated = _count_evaluations(monkeypatch, fail_on="avnorm-rms")
    with pytest.raises(RetrofitError, match="out of memory"):
        experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK, progress=False)
    assert evaluated == ["base", "softmax", "psoftmax-p2", "avnorm-rms"]
    saved = json.loads((out / "eval" / "results.json").read_text())
    assert [m["name"] for m in saved["models"]] == ["base", "softmax", "psoftmax-p2"]
    monkeypatch.undo()  # no more failures; count afresh
    evaluated = _count_evaluations(monkeypatch)
    results = experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK, progress=False)
    assert evaluated == ["avnorm-rms", "ssmax", "softmax1"]
    assert [m["name"] for m in results["evaluation"]["models"]] == ["base", "softmax", "psoftmax-p2",
                                                                  "avnorm-rms", "ssmax", "softmax1"]


def test_eval_base_false_leaves_the_base_out_of_the_evaluation(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)
    evaluated = _count_evaluations(monkeypatch)
    results = experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK + ["experiment.eval_base=false"],
                                        progress=False)
    arms = [a.name for a in load_recipe(experiment.DEMO_RECIPE).section("experiment").arms]
    assert evaluated == []  # the arms' results are reused, the base is not evaluated
    assert [m["name"] for m in results["evaluation"]["models"]] == arms
    assert "| base |" not in (out / "report.md").read_text()


def test_a_changed_evaluation_setting_evaluates_again(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)
    evaluated = _count_evaluations(monkeypatch)
    experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK + ["experiment.train_len=128"], progress=False)
    assert evaluated == ["base", "softmax", "psoftmax-p2", "avnorm-rms", "ssmax", "softmax1"]


def test_the_report_compares_directions_with_a_reference(demo_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(demo_run[0], out)
    table = {"context_lengths": [64, 128, 256], "pe": {"base": [1.0, 2.0, 3.0], "p2": [1.5, 1.0, 2.0]}}
    (tmp_path / "ref.json").write_text(json.dumps(table))
    reference = (f"experiment.reference={{file: {tmp_path / 'ref.json'}, control: pe.base, "
                 "arms: {psoftmax-p2: pe.p2}, note: a made-up table}")
    results = experiment.run_experiment(experiment.DEMO_RECIPE, out, SHRINK + [reference], progress=False)
    assert results["reference"]["arms"]["psoftmax-p2"]["values"] == [1.5, 1.0, 2.0]
    ours = {m["name"]: {r["length"]: r["l1"] for r in m["counting"]} for m in results["evaluation"]["models"]}
    report = (out / "report.md").read_text()
    assert "## Against the published table" in report and "a made-up table" in report
    for n, published in ((64, +0.5), (128, -1.0)):  # 256 is not evaluated here: not in the table
        delta = ours["psoftmax-p2"][n] - ours["softmax"][n]
        agree = (0 if abs(delta) < 0.01 else delta > 0) == (published > 0)  # published: clear signs
        assert f"| {n} | {n // 64:g} | {delta:+.3f} | {published:+.3f} | {'agrees' if agree else 'differs'} |" in report
    assert "| 256 |" not in report.split("## Against")[1].split("## Plots")[0]


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
    folder = Path(experiment.__file__).parent.parent / "recipes"
    for name in ("demo", "counting-psoftmax", "gpt2-avnorm-retrofit", "llama-avnorm-retrofit", "llama-recovery",
                 "llama-retrofit-v2", "nope", "norm-comparison"):
        assert load_recipe(folder / f"{name}.yaml").section("experiment").arms, name
    assert (Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml").is_file()  # recipes/ links there


def test_experiment_without_section_is_refused(tmp_path):
    recipe = Path(experiment.__file__).parent.parent / "recipes" / "train-tiny-counting.yaml"
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


def test_names_in_experiment_results_render_as_text(tmp_path):
    """report.md is rebuilt from results.json by `retrofit report DIR`: the recipe's, arms' and models' names, the
    base and the failure messages it holds are shown as text (no heading, no tag, no extra table cell)."""
    from retrofit.experiment.report import write_experiment_report
    from tests.evaluate.test_report import HOSTILE, assert_renders_as_text, fake_results

    evaluation = fake_results()
    evaluation["models"][1]["name"] = HOSTILE
    arm = {"patch": {"norm": "<i>avnorm</i>"}, "settings": {"lr": 0.001}, "failed": "<img src=y>\n# Owned",
           "train_loss": None, "recovery": None}
    results = {"schema": "retrofit.experiment/1", "recipe": "<b>r</b>\n# Owned", "hardware": {"cpu": "<b>x</b>"},
               "wall_time_s": {"base": 1.0}, "base": "runs/`b`\n# Owned", "arms": {HOSTILE: arm},
               "control": "<b>c</b>", "seeds": None, "evaluation": evaluation, "reference": None}
    (tmp_path / "eval").mkdir()
    assert_renders_as_text(write_experiment_report(results, tmp_path).read_text())
