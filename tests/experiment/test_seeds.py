"""Training seeds as an axis (#37): experiment.seeds runs each arm under each seed; the evaluation pairs runs within
a seed; reports give means and differences over seeds; resume and --merge keep them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrofit.errors import RetrofitError
from retrofit.evaluate.intervals import mean_interval
from retrofit.evaluate.merge import merge_results
from retrofit.evaluate.report import validate
from retrofit.experiment import driver as experiment
from retrofit.experiment import results as results_module
from retrofit.recipe import load_recipe
from tests.experiment.test_experiment import SHRINK

TWO_ARMS = "experiment.arms=[{name: softmax, patch: {norm: softmax}}, {name: p2, patch: {norm: psoftmax, p: 2.0}}]"
SEEDED = SHRINK + [TWO_ARMS, "experiment.seeds=[0, 1]", "eval.lengths=[64]", "experiment.finetune_steps=6"]


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeded")
    return out, experiment.run_experiment(experiment.DEMO_RECIPE, out, SEEDED, progress=False)


def _entry(results, name):
    return next(m for m in results["evaluation"]["models"] if m["name"] == name)


def test_each_arm_runs_under_each_seed_and_the_summary_is_over_seeds(seeded_run):
    out, results = seeded_run
    runs = ["softmax-seed0", "p2-seed0", "softmax-seed1", "p2-seed1"]  # seed-major
    assert list(results["arms"]) == runs and results["seeds"] == [0, 1]
    assert [(results["arms"][r]["arm"], results["arms"][r]["seed"]) for r in runs] == \
        [("softmax", 0), ("p2", 0), ("softmax", 1), ("p2", 1)]
    for run in runs:
        assert load_recipe(out / "arms" / run / "recipe.yaml").train.seed == results["arms"][run]["seed"]
    evaluation = results["evaluation"]
    validate(evaluation)
    l1 = {m["name"]: m["counting"][0]["l1"] for m in evaluation["models"]}
    assert l1["softmax-seed0"] != l1["softmax-seed1"]  # the seed changes the finetuned model
    summary = evaluation["seeds"]
    assert summary["control"] == "softmax" and summary["seeds"] == [0, 1] and summary["metric"] == "l1"
    row = next(r for r in summary["arms"] if r["arm"] == "p2")
    assert row["seeds"] == 2 and row["value"] == pytest.approx((l1["p2-seed0"] + l1["p2-seed1"]) / 2)
    assert row["ci95"] == pytest.approx(list(mean_interval([l1["p2-seed0"], l1["p2-seed1"]])))
    (diff,) = summary["differences"]
    per_seed = [np.mean(np.subtract(_entry(results, f"p2-seed{s}")["counting"][0]["sequence_l1"],
                                    _entry(results, f"softmax-seed{s}")["counting"][0]["sequence_l1"]))
                for s in (0, 1)]  # within a seed, sequence by sequence
    assert diff["arm"] == "p2" and diff["seed_differences"] == pytest.approx(per_seed)
    assert diff["difference"] == pytest.approx(np.mean(per_seed))
    assert diff["ci95"] == pytest.approx(list(mean_interval(per_seed)))
    report = (out / "report.md").read_text()
    assert "### Mean over seeds [0, 1]" in report and "### Difference to softmax over seeds" in report
    assert "(n=2)" in report.split("### Difference to softmax over seeds")[1]
    eval_md = (out / "eval" / "results.md").read_text()
    assert "## Mean over seeds [0, 1]" in eval_md


def test_a_rerun_resumes_every_seed_and_merge_keeps_the_summary(seeded_run, tmp_path, monkeypatch):
    out, results = seeded_run
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    seen = []
    real = results_module.evaluate_models
    monkeypatch.setattr(results_module, "evaluate_models", lambda s, spec: seen.extend(spec.names) or real(s, spec))
    again = experiment.run_experiment(experiment.DEMO_RECIPE, copy, SEEDED, progress=False)
    assert seen == [] and again["evaluation"]["seeds"] == results["evaluation"]["seeds"]
    evaluation = json.loads((out / "eval" / "results.json").read_text())
    halves = []
    for seed in (0, 1):  # each seed's runs in a file of its own, as two evaluations run apart
        part = dict(evaluation, models=[m for m in evaluation["models"] if m.get("seed") in (None, seed)
                                        and (m["name"] != "base" or seed == 0)])
        halves.append(tmp_path / f"seed{seed}.json")
        halves[-1].write_text(json.dumps(part))
    merged = merge_results(halves, reference="softmax")  # an arm's name: its run under every seed
    assert merged["seeds"]["differences"] == evaluation["seeds"]["differences"]
    assert merged["seeds"]["arms"] == evaluation["seeds"]["arms"]


def test_language_model_runs_are_paired_within_their_seed_only():
    from retrofit.evaluate.compare import judged

    def entry(name, arm, seed, losses, sha="w"):
        return {"name": name, "arm": arm, "seed": seed, "model_type": "llama",
                "lengths": [{"length": 16, "loss": float(np.mean(losses)), "windows": len(losses),
                             "windows_sha1": sha, "window_losses": losses}]}
    results = {"schema": "retrofit.eval/2", "train_len": 16, "lengths": [16], "models": [
        entry("c-seed0", "c", 0, [3.0, 3.2, 3.4]), entry("a-seed0", "a", 0, [2.9, 3.0, 3.3]),
        entry("c-seed1", "c", 1, [3.1, 3.3, 3.5]), entry("a-seed1", "a", 1, [3.1, 3.2, 3.4])]}
    out = judged(results, "c")
    pairs = [(r["reference"], r["model"]) for r in out["comparisons"]["rows"]]
    assert pairs == [("c-seed0", "a-seed0"), ("c-seed1", "a-seed1")]  # never across seeds
    (diff,) = out["seeds"]["differences"]
    assert diff["seed_differences"] == pytest.approx([-0.1333333, -0.0666667])
    assert diff["ci95"] == pytest.approx(list(mean_interval([-0.4 / 3, -0.2 / 3])))
    assert out["seeds"]["arms"][0]["ci95"] == pytest.approx(list(mean_interval([3.2, 3.3])))  # c over seeds
    with pytest.raises(RetrofitError, match="--reference z is not one of the models"):
        judged(results, "z")


@pytest.mark.parametrize("override,match", [
    ("experiment.seeds=[]", "non-empty list of distinct integers"),
    ("experiment.seeds=[1, 1]", "distinct"),
    ("experiment.seeds=[-1]", ">= 0"),
])
def test_bad_seeds_are_refused(override, match):
    with pytest.raises(RetrofitError, match=match):
        load_recipe(experiment.DEMO_RECIPE, [override])


def test_an_arm_with_its_own_seed_or_a_clashing_name_is_refused():
    own = "experiment.arms=[{name: softmax, patch: {norm: softmax}, seed: 3}]"
    with pytest.raises(RetrofitError, match="sets its own seed and experiment.seeds is set"):
        load_recipe(experiment.DEMO_RECIPE, [own, "experiment.seeds=[0]"])
    clash = "experiment.arms=[{name: a, patch: {norm: softmax}}, {name: a-seed0, patch: {norm: softmax}}]"
    with pytest.raises(RetrofitError, match="run name is also an arm's name"):
        load_recipe(experiment.DEMO_RECIPE, [clash, "experiment.seeds=[0]"])
