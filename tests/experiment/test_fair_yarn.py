"""recipes/fair-yarn.yaml's two experiment keys: a base per seed (experiment.base_per_seed) and every model evaluated
raw and under YaRN (experiment.eval_variants), each arm judged against the control under the same variant.

    pytest tests/experiment/test_fair_yarn.py

A tiny run of the recipe itself (2 seeds, 3 base steps, 2 finetune steps, lengths 16 and 64) on books made here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrofit import patching
from retrofit.errors import RetrofitError
from retrofit.evaluate.intervals import mean_interval
from retrofit.experiment import driver as experiment
from retrofit.load import load
from retrofit.recipe import load_recipe
from tests.experiment.test_post_recipes import RECIPES, TINY_LM, books, bpe  # noqa: F401 -- fixtures

RECIPE = RECIPES / "fair-yarn.yaml"
VARIANTS = "experiment.eval_variants=[{name: raw}, {name: yarn4, rope: 'yarn:4,original=16'}]"


@pytest.fixture(scope="module")
def fair_run(books, bpe, tmp_path_factory):  # noqa: F811 -- the imported fixtures
    out = tmp_path_factory.mktemp("fair")
    overrides = TINY_LM + [f"model.tokenizer={bpe}", f"data.files=[{','.join(map(str, books['train']))}]",
                           f"data.val_files=[{books['val']}]", f"experiment.eval_data=[{books['val']}]",
                           "experiment.seeds=[0, 1]", "experiment.recovery_at=[0, 2]", VARIANTS]
    owners = []
    real = patching._extend_rope
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(patching, "_extend_rope",
                        lambda model, spec, temperature_owner=None: owners.append(temperature_owner)
                        or real(model, spec, temperature_owner=temperature_owner))
    try:
        results = experiment.run_experiment(RECIPE, out, overrides, progress=False)
    finally:
        monkeypatch.undo()
    return out, results, owners


def test_each_seed_trains_its_own_base_and_its_arms_start_from_it(fair_run):
    out, results, _ = fair_run
    assert all(a["failed"] is None for a in results["arms"].values()), results["arms"]
    for seed in (0, 1):
        assert load_recipe(out / f"base-seed{seed}" / "recipe.yaml").train.seed == seed
        for arm in ("softmax", "avnorm-layer", "ssmax"):
            source = load_recipe(out / "arms" / f"{arm}-seed{seed}" / "recipe.yaml").model.source
            assert source.endswith(f"base-seed{seed}"), source
    assert not (out / "base").exists()
    weights = [load(str(out / f"base-seed{s}"), dtype="float32").get_input_embeddings().weight for s in (0, 1)]
    assert not torch.equal(*weights)  # two inits, two data orders: two bases
    assert set(results["base"]) == {0, 1}


def test_every_model_is_evaluated_raw_and_under_yarn_with_ssmax_owning_the_temperature(fair_run):
    _, results, owners = fair_run
    models = {m["name"]: m for m in results["evaluation"]["models"]}
    runs = [f"base-seed{s}" for s in (0, 1)] + [f"{a}-seed{s}" for s in (0, 1)
                                                for a in ("softmax", "avnorm-layer", "ssmax")]
    assert set(models) == {f"{r}+{v}" for r in runs for v in ("raw", "yarn4")}
    for name, m in models.items():
        variant = name.rsplit("+", 1)[1]
        assert m["variant"] == variant and m["arm"] == f"{m['trained_as']}+{variant}"
        assert m["rope"] == ("none" if variant == "raw" else "yarn x4 (orig 16)")
    # extend_rope ran on the patched arms (the bases are patched with softmax + rope instead): only SSMax owns it
    assert sorted(owners, key=str) == [None, None, None, None, "ssmax", "ssmax"]


def test_each_arm_is_judged_against_the_control_under_the_same_variant(fair_run):
    out, results, _ = fair_run
    summary = results["evaluation"]["seeds"]
    assert summary["controls"]["avnorm-layer+yarn4"] == "softmax+yarn4"
    assert summary["control"] == "softmax+raw" and "ssmax+raw" not in summary["controls"]  # the control itself
    models = {m["name"]: m for m in results["evaluation"]["models"]}
    row = next(r for r in summary["differences"] if r["arm"] == "avnorm-layer+yarn4" and r["length"] == 64)
    per_seed = [np.mean(np.subtract(_windows(models[f"avnorm-layer-seed{s}+yarn4"], 64),
                                    _windows(models[f"softmax-seed{s}+yarn4"], 64))) for s in (0, 1)]
    assert row["against"] == "softmax+yarn4" and row["seed_differences"] == pytest.approx(per_seed)
    assert row["ci95"] == pytest.approx(list(mean_interval(per_seed)))
    raw = [np.mean(np.subtract(_windows(models[f"avnorm-layer-seed{s}+yarn4"], 64),
                               _windows(models[f"softmax-seed{s}+raw"], 64))) for s in (0, 1)]
    assert not np.allclose(raw, per_seed)  # not against the raw control
    report = (out / "report.md").read_text()
    assert "### Difference to the control under the same variant over seeds" in report


def _windows(model: dict, length: int) -> list[float]:
    return next(r for r in model["lengths"] if r["length"] == length)["window_losses"]


@pytest.mark.parametrize("override,match", [
    ("experiment.eval_variants=[{name: raw}, {name: raw}]", "duplicate names"),
    ("experiment.eval_variants=[{name: yarn4, rope: 'yarn:x'}]", "rope factor must be a number"),
    ("experiment.eval_variants=[{name: y, patch: {norm: avnorm}}]", r"must be \{name: WORD"),
    ("experiment.eval_variants=[{name: 'a+b'}]", "letters, digits"),
    ("experiment.eval_variants=[]", "non-empty list"),
    ("experiment.seeds=null", "base_per_seed trains one base per seed"),
])
def test_bad_fair_test_keys_are_refused_before_anything_trains(override, match):
    with pytest.raises(RetrofitError, match=match):
        load_recipe(RECIPE, [override])
