"""retrofit.recipe: every shipped recipe validates; keys documented; bad input is a one-line error."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError
from retrofit.recipe import (
    EXTRA_SECTIONS,
    Recipe,
    apply_overrides,
    documentation,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    register_section,
    save_recipe,
)

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
BASE = {"model": {"source": "gpt2"}, "data": {"files": ["train.txt"]}}


def make(**sections) -> Recipe:
    raw = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return recipe_from_dict(raw)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    text = path.read_text()
    # a header with the exact command
    assert text.startswith("#") and re.search(r"retrofit (train|experiment|demo)\b", text.split("\n\n")[0]), path.name


def test_the_two_required_recipes_exist():
    assert {"train-tiny-counting.yaml", "gpt2-avnorm-retrofit.yaml"} <= {p.name for p in RECIPES}


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in documentation() if not doc.strip()]
    assert not undocumented
    keys = {key for key, _, _ in documentation()}
    assert {"patch.p", "patch.calibrate_tokens", "train.peft.r", "data.counting.alphabet", "eval.at_steps"} <= keys


@pytest.mark.parametrize("sections, message", [
    ({"train": {"setps": 5}}, "unknown recipe key train.setps (did you mean 'steps'?)"),
    ({"trian": {"steps": 5}}, "unknown recipe section 'trian' (did you mean 'train'?)"),
    ({"data": {"seq_len": 0}}, "data.seq_len must be >= 2"),
    ({"train": {"lr": -1.0}}, "train.lr must be >= 0"),
    ({"train": {"steps": "many"}}, "train.steps must be an integer, got 'many'"),
    ({"train": {"precision": "bf61"}}, "train.precision must be one of auto, fp32, bf16, fp16"),
    ({"patch": {"norm": "avnrom"}}, "unknown norm 'avnrom' (did you mean 'avnorm'?)"),
    ({"patch": {"norm": "psoftmax", "kind": "rms"}}, "norm 'psoftmax' has no option 'kind'"),
    ({"patch": {"norm": "avnorm", "kind": "rsm"}}, "avnorm kind must be one of"),
    ({"patch": {"p": 2.0}}, "p given but patch.norm is null"),
    ({"patch": {"norm": "psoftmax", "calibrate_tokens": 128}},
     "patch.calibrate_tokens sets the per-head gains of avnorm"),
    ({"model": {"source": None, "config": {"model_type": "llama", "hiden_size": 8}, "tokenizer": "t"}},
     "llama has no config key 'hiden_size' (did you mean 'hidden_size'?)"),
    ({"model": {"source": None, "config": {"model_type": "lama"}, "tokenizer": "t"}}, "did you mean 'llama'?"),
    ({"train": {"batch_size": 6, "micro_batch_size": 4}}, "must be a multiple of micro_batch_size"),
    ({"train": {"init_len": 100, "double_every": 5}}, "divided by a power of two"),
    ({"output": {"trackers": ["tensorbord"]}}, "did you mean 'tensorboard'?"),
    ({"data": {"files": None}}, "the lm task needs data.dataset (Hub) or data.files (local), or both"),
    ({"data": {"files": []}}, "data.files is an empty list"),
    ({"data": {"val_files": ["v.txt"], "val_split": "validation"}}, "set val_files or val_split, not both"),
])
def test_bad_recipes_fail_in_one_line(sections, message):
    with pytest.raises(RetrofitError) as err:
        make(**sections)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_output_trackers_accepts_every_tracker_accelerate_has():
    """output.trackers took tensorboard and wandb only; accelerate logs to more (issue 53)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS
    assert make(output={"trackers": list(LOGGER_TYPE_TO_CLASS)}).output.trackers == list(LOGGER_TYPE_TO_CLASS)


def test_overrides_reach_flat_norm_options_and_nested_sections():
    raw = apply_overrides({k: dict(v) for k, v in BASE.items()},
                          ["train.steps=200", "patch.norm=psoftmax", "patch.p=2", "train.peft.r=4",
                           "eval.lengths=[64, 128]", "data.counting.alphabet=5"])
    recipe = recipe_from_dict(raw)
    assert recipe.train.steps == 200 and recipe.patch.options == {"p": 2.0}
    assert recipe.train.peft.r == 4 and recipe.eval.lengths == [64, 128] and recipe.data.counting.alphabet == 5
    with pytest.raises(RetrofitError, match="must look like section.key=value"):
        apply_overrides({}, ["train.steps"])


def test_recipe_round_trips_through_yaml(tmp_path):
    recipe = make(patch={"norm": "avnorm", "kind": "layer"}, train={"peft": {"r": 2}})
    save_recipe(recipe, tmp_path / "r.yaml")
    again = load_recipe(tmp_path / "r.yaml")
    assert recipe_to_dict(again) == {**recipe_to_dict(recipe), "name": recipe.name}


def test_a_registered_section_is_parsed_and_validated(monkeypatch):
    @dataclasses.dataclass
    class Experiment:
        arms: list[str] = dataclasses.field(default_factory=list, metadata={"doc": "arm names"})

    monkeypatch.setitem(EXTRA_SECTIONS, "experiment", Experiment)
    register_section("experiment", Experiment)
    recipe = recipe_from_dict({**BASE, "experiment": {"arms": ["l1", "avnorm"]}})
    assert recipe.section("experiment").arms == ["l1", "avnorm"]
    assert recipe_to_dict(recipe)["experiment"] == {"arms": ["l1", "avnorm"]}
    with pytest.raises(RetrofitError, match="unknown recipe key experiment.armz"):
        recipe_from_dict({**BASE, "experiment": {"armz": []}})


def test_missing_and_malformed_recipe_files(tmp_path):
    with pytest.raises(RetrofitError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(RetrofitError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_old_calibrate_recipe_keys_read_as_calibrate_tokens(tmp_path):
    from retrofit.recipe import recipe_from_dict
    (tmp_path / "t.txt").write_text("some text\n")
    base = {"model": {"source": "gpt2"}, "data": {"files": [str(tmp_path / "t.txt")]}}  # nothing is loaded
    old = recipe_from_dict({**base, "patch": {"norm": "avnorm", "calibrate": 64}, "recovery": {"calibrate": 32}})
    new = recipe_from_dict({**base, "patch": {"norm": "avnorm", "calibrate_tokens": 64},
                            "recovery": {"calibrate_tokens": 32}})
    assert old.patch.calibrate_tokens == new.patch.calibrate_tokens == 64 and "calibrate" not in old.patch.options
    assert old.section("recovery").calibrate_tokens == new.section("recovery").calibrate_tokens == 32
