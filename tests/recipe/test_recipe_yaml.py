"""Recipe YAML as it is read: floats without a dot load, non-numbers and infinite rates are refused, plain anchors
load while alias bombs and self-references are refused fast in one short line, and values echoed in errors are cut."""

from __future__ import annotations

import dataclasses
import time

import pytest
import yaml

from retrofit.errors import RetrofitError, quoted
from retrofit.experiment import driver as experiment
from retrofit.io.readers import MAX_VALUES, load_yaml
from retrofit.recipe import load_recipe, recipe_from_dict
from tests.train.test_checkpoints import counting_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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


def alias_bomb(levels: int) -> str:
    """The 'billion laughs' recipe: each level a list of 9 aliases of the one before, under train.steps
    (9**levels values once written out; ~550 bytes at 9 levels)."""
    lines = ["train:", "  steps:", "    - &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    lines += [f"    - &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [9, 10])
def test_an_alias_bomb_is_refused_fast_in_one_short_line(levels, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels))
    assert path.stat().st_size < 700
    start = time.perf_counter()
    with pytest.raises(RetrofitError) as err:
        load_recipe(path)
    assert time.perf_counter() - start < 2
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    assert f"expands to more than {MAX_VALUES:,} values through its aliases" in message and str(path) in message


def test_a_self_referencing_alias_and_a_deep_recipe_are_one_line(tmp_path):
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("a: &a [*a]\ntrain: {steps: *a}\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("train:\n  steps: " + "[" * 1000 + "]" * 1000 + "\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(counting_recipe(tmp_path / "run")))
    for path in (cycle, deep):
        with pytest.raises(RetrofitError, match=r"nests deeper than 32 levels") as err:
            load_recipe(path)
        assert "\n" not in str(err.value)
    with pytest.raises(RetrofitError, match=r"override train.steps nests deeper"):
        load_recipe(plain, ["train.steps=" + "[" * 40 + "]" * 40])


def test_a_recipe_with_plain_anchors_still_loads(tmp_path):
    """Anchors are useful (one list shared by two keys): a few aliases load exactly as PyYAML reads them."""
    raw = {k: v for k, v in counting_recipe(tmp_path / "run").items() if k != "eval"}
    text = yaml.safe_dump(raw) + "eval:\n  batches: 1\n  lengths: &lengths [32, 64]\n" \
        "experiment:\n  recovery_lengths: *lengths\n  arms: [{name: softmax, patch: {norm: softmax}}]\n"
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    assert load_yaml(text, "x") == yaml.safe_load(text)
    recipe = load_recipe(path)
    assert recipe.eval.lengths == [32, 64] and recipe.section("experiment").recovery_lengths == [32, 64]


def test_a_recipe_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: a recipe's patch written `kind: rms` then `kind: layer` trained
    kind=layer without a word. Refused in one line, naming the key and its line (a merge key `<<:` still
    overrides)."""
    path = tmp_path / "twice.yaml"
    path.write_text("model: {config: {model_type: llama}}\npatch:\n  norm: avnorm\n  kind: rms\n  kind: layer\n")
    with pytest.raises(RetrofitError, match=r"twice.yaml: kind is given twice \(line 5\); give it once"):
        load_recipe(path)


def test_values_echoed_in_errors_are_cut():
    huge = list(range(10**6))
    start = time.perf_counter()
    text = quoted(huge)
    assert time.perf_counter() - start < 0.1 and text == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"
    assert len(quoted("x" * 10**6)) <= 80 and len(quoted([huge] * 3)) <= 80
    assert quoted("abc") == "'abc'" and quoted(-1) == "-1"
    with pytest.raises(RetrofitError) as err:
        recipe_from_dict({**counting_recipe("x"), "train": {"steps": huge}})
    assert len(str(err.value)) < 200 and "train.steps must be an integer, got [0, 1, 2" in str(err.value)


def test_an_eval_lengths_override_wins_over_the_experiments_recovery_lengths(tmp_path):
    """Issue 62: `retrofit train RECIPE eval.lengths=[64]` of an experiment recipe evaluated at
    experiment.recovery_lengths all the same. What the user typed wins; the recipe file alone keeps the
    experiment's lengths for the loop."""
    raw = counting_recipe(tmp_path / "run")
    raw["eval"] = {"batches": 1, "lengths": [32, 128]}
    raw["experiment"] = {"recovery_lengths": [16, 48], "arms": [{"name": "softmax", "patch": {"norm": "softmax"}}]}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert load_recipe(path).loop_eval_lengths() == [16, 48]
    typed = load_recipe(path, ["eval.lengths=[64]"])
    assert typed.loop_eval_lengths() == [64] and typed.eval.lengths == [64]
    assert load_recipe(path, ["train.steps=3"]).loop_eval_lengths() == [16, 48]  # only eval.lengths itself wins


def test_a_recipe_typo_is_refused_before_torch_is_imported(tmp_path):
    """Issue 62: `retrofit train bad.yaml` imported the norms, the kernels and torch (8-10 s on a small VM) before
    it read the YAML. Every key is checked first, from the sections' annotations: in a fresh process the one-line
    error comes and torch is still not imported (nested sections and lists of them included)."""
    import subprocess
    import sys
    from pathlib import Path
    cases = {"train: {stpes: 3}\n": "unknown recipe key train.stpes (did you mean 'steps'?)",
             "experiment: {arms: [{name: a, recovry: {}}]}\n":
                 "unknown recipe key experiment.arms[0].recovry (did you mean 'recovery'?)",
             "modle: {}\n": "unknown recipe section 'modle' (did you mean 'model'?)"}
    root = Path(__file__).resolve().parents[2]
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text("model: {config: {model_type: llama}}\n" + text)
        code = ("import sys; from retrofit.cli import main\n"
                f"rc = main(['train', {str(path)!r}])\n"
                "print('torch imported:', 'torch' in sys.modules, 'transformers' in sys.modules); sys.exit(rc)\n")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith(f"retrofit train: error: {message}") and run.stderr.count("\n") == 1, run.stderr
        assert "torch imported: False False" in run.stdout


def test_the_schemas_baseline_norm_is_the_registrys():
    """recipe/experiment_section.py names the default control without importing the norms (BASELINE_NORM): held
    equal."""
    from retrofit.norms import baseline_norm
    from retrofit.recipe.experiment_section import BASELINE_NORM, ExperimentSection
    control = next(f for f in dataclasses.fields(ExperimentSection) if f.name == "control")
    assert BASELINE_NORM == baseline_norm() == control.default
