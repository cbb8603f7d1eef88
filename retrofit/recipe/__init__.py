"""Recipes: YAML files whose keys are the fields of the section dataclasses (recipe/sections.py; `model` in
recipe/model.py, `recovery` in recipe/recovery_section.py).

    recipe = load_recipe("recipes/train-tiny-counting.yaml", ["train.steps=200", "patch.norm=psoftmax", "patch.p=2"])
    recipe.train.steps                      # 200
    save_recipe(recipe, "runs/x/recipe.yaml")

Sections: model, patch, data, train, eval, output. Every field carries its documentation (`doc`
metadata); an unknown key is an error naming the closest valid key; wrong types and impossible
values fail here, before any model is loaded. Optional top-level sections are registered with
`register_section(name, cls)` and land in `recipe.extras`; `experiment` (recipe/experiment_section.py) is one.
The machinery that builds them from YAML (types, one-line errors, overrides) is recipe/schema.py.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

from ..errors import RetrofitError, closest, quoted
from ..io.atomic import atomic_write_text
from .experiment_section import ArmSection, ExperimentSection, ReferenceSection, check_arm_name, seeded_name
from .model import ModelSection
from .recovery_section import RecoverySection, ScheduleSection
from .schema import apply_overrides, build, check_keys, load_json, load_yaml, read_yaml_file, require, setting, to_plain
from .schema import documentation as _documentation
from .sections import (
    CountingOptions,
    DataSection,
    EvalSection,
    OutputSection,
    PasskeyOptions,
    PatchSection,
    PeftSection,
    TrainSection,
)

# Optional top-level sections other modules add (the experiment engineer's `experiment` section).
EXTRA_SECTIONS: dict[str, type] = {}


def register_section(name: str, cls: type) -> type:
    """Make `name:` a valid top-level recipe key, parsed into dataclass `cls` (found in recipe.extras[name])."""
    require(dataclasses.is_dataclass(cls), f"recipe section {name!r} must be a dataclass")
    EXTRA_SECTIONS[name] = cls
    return cls


@dataclass
class Recipe:
    name: str | None = setting(None, "run name (default output folder runs/<name>); null = the recipe file's stem")
    model: ModelSection = setting(factory=ModelSection, doc="what to load (source) or build (config)")
    patch: PatchSection = setting(factory=PatchSection, doc="the attention patch")
    data: DataSection = setting(factory=DataSection, doc="what to train on")
    train: TrainSection = setting(factory=TrainSection, doc="the optimization")
    eval: EvalSection = setting(factory=EvalSection, doc="periodic evaluation")
    output: OutputSection = setting(factory=OutputSection, doc="where results go")
    extras: dict = setting(factory=dict, doc="registered optional sections by name (see register_section)")
    # the dotted keys given as command-line overrides (load_recipe): an explicit eval.lengths=[64] is not replaced by
    # experiment.recovery_lengths in the training loop (issue 62). Not a recipe key: never saved.
    typed: ClassVar[frozenset] = frozenset()

    def __post_init__(self):
        data, train = self.data, self.train
        if train.init_len is not None:
            ratio = data.seq_len / train.init_len
            require(ratio >= 1 and ratio == 2 ** round(math.log2(ratio)),
                  f"train.init_len {train.init_len} must be data.seq_len {data.seq_len} divided by a power of two")
        if self.model.config is not None and data.task == "counting":
            vocab = self.model.config.get("vocab_size")
            require(vocab is None or vocab >= data.counting.alphabet,
                  f"model.config.vocab_size {vocab} is smaller than data.counting.alphabet {data.counting.alphabet}")
        if data.task != "counting" and self.model.source is None:
            require(self.model.tokenizer is not None,
                  f"data.task {data.task} needs a tokenizer: set model.tokenizer (a Hub id or folder)")
        if data.task == "lm" and self.eval.lengths and data.val_files is None and data.val_split is None:
            require(data.val_blocks >= 1, "data.val_blocks must be >= 1 to evaluate without val_files/val_split")

    def eval_lengths(self) -> list[int]:
        return list(self.eval.lengths or [self.data.seq_len])

    def loop_eval_lengths(self) -> list[int]:
        """The lengths the training loop evaluates at: eval.lengths, except in an experiment's recipe, whose
        eval.lengths are its length evaluation (retrofit.evaluate: windows, intervals, up to 32K): there the loop
        evaluates where each of the experiment's stages does, experiment.recovery_lengths or data.seq_len."""
        experiment = self.section("experiment")
        if experiment is None or "eval.lengths" in self.typed:  # what the user typed on the command line wins
            return self.eval_lengths()
        return sorted(set(experiment.recovery_lengths or [self.data.seq_len]))

    def section(self, name: str):
        """A registered optional section, or None when the recipe does not have it."""
        return self.extras.get(name)


SECTIONS = {f.name: f for f in dataclasses.fields(Recipe) if f.name not in ("name", "extras")}
SECTION_TYPES = {name: cls for name, cls in typing.get_type_hints(Recipe).items() if name in SECTIONS}


def recipe_from_dict(raw: dict, name: str | None = None) -> Recipe:
    require(isinstance(raw, dict),
            "a recipe must be a YAML mapping of sections (model, patch, data, train, eval, output)")
    valid = ["name", *SECTIONS, *EXTRA_SECTIONS]
    for key in raw:
        require(key in valid, f"unknown recipe section {quoted(key)}{closest(key, valid)}; "
                           f"valid sections: {', '.join(valid)}")
    core = {k: v for k, v in raw.items() if k not in EXTRA_SECTIONS}
    for key, value in core.items():
        require(key == "name" or isinstance(value, dict),
                f"recipe section {key} must be a mapping, got {quoted(value)}")
    core.setdefault("name", name)
    for key, value in raw.items():  # every key first, values after: a typo is refused before torch is imported
        if key != "name":
            check_keys(EXTRA_SECTIONS.get(key) or SECTION_TYPES[key], value or {}, key)
    extras = {k: build(EXTRA_SECTIONS[k], v or {}, k) for k, v in raw.items() if k in EXTRA_SECTIONS}
    recipe = build(Recipe, core, "")
    recipe.extras = extras
    check_schedule_endpoints(recipe.patch, extras.get("recovery"))
    for section in extras.values():  # a registered section may check itself against the rest of the recipe
        if callable(getattr(section, "check_recipe", None)):
            section.check_recipe(recipe)
    return recipe


def check_schedule_endpoints(patch: PatchSection, recovery) -> None:
    """recovery.schedule's start and end (defaults filled in) by the patch's norm's own option rules, as soon as the
    recipe is read: an avnorm floor ending below 0 is a one-line error before any model loads."""
    from ..norms import NORMS, make_options
    schedule = getattr(recovery, "schedule", None)
    cls = NORMS.get(patch.norm) if schedule is not None and patch.norm else None
    if cls is None or cls.scheduled_option is None:
        return  # no schedule, or a norm without a knob: the training setup names the norms that have one
    for key, default in (("start", cls.schedule_identity), ("end", None)):
        value = getattr(schedule, key)
        value = default if value is None else value
        if value is None:
            continue
        try:
            make_options(patch.norm, **{**patch.options, cls.scheduled_option: value})
        except RetrofitError as err:
            raise RetrofitError(f"recovery.schedule.{key} {value:g}: {err}") from None


def load_recipe(path, overrides=()) -> Recipe:
    """Read a YAML recipe, apply dotted overrides, validate everything; errors are one line."""
    path = Path(path)
    require(path.is_file(), f"no such recipe file: {path}")
    try:
        raw = load_yaml(path.read_text(), str(path)) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RetrofitError(f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    require(isinstance(raw, dict), f"{path}: a recipe must be a YAML mapping of sections")
    recipe = recipe_from_dict(apply_overrides(raw, overrides), name=path.stem)
    recipe.typed = frozenset(item.split("=", 1)[0].strip() for item in overrides)
    return recipe


def resumed_recipe(recipe: str | None, overrides: list[str], resume: str | None) -> tuple[str | None, list[str]]:
    """The recipe file and overrides a resumed run goes on with (`retrofit train [RECIPE] --resume DIR`): without a
    recipe, DIR's recipe.yaml (the recipe it was trained with); a first argument that is an override (train.steps=30,
    not a file) is then one of the overrides. Without `resume`, (recipe, overrides) as given."""
    if not resume:
        return recipe, list(overrides)
    if recipe is not None:
        if "=" not in recipe or Path(recipe).expanduser().exists():
            return recipe, list(overrides)
        overrides = [recipe, *overrides]
    saved = Path(resume).expanduser() / "recipe.yaml"
    if not saved.is_file():
        raise RetrofitError(f"{resume} has no recipe.yaml to resume with; name the recipe: "
                            f"retrofit train RECIPE --resume {resume}")
    return str(saved), list(overrides)


def documentation(cls=Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every recipe field, nested sections included (for Recipe: the registered
    optional sections too, e.g. experiment.*, recovery.*)."""
    rows = _documentation(cls, prefix)
    if cls is Recipe:
        rows = [r for r in rows if r[0] != f"{prefix}extras"]
        for name, section in EXTRA_SECTIONS.items():
            rows += _documentation(section, f"{prefix}{name}.")
    return rows


def documentation_markdown() -> str:
    """documentation() as the markdown table docs/reference/recipe.md holds (`retrofit train --keys --markdown`)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    rows = [f"| `{key}` | `{cell(default)}` | {cell(doc)} |" for key, default, doc in documentation()]
    return "\n".join(["| key | default | what it is |", "|---|---|---|", *rows])


def recipe_to_dict(recipe: Recipe) -> dict:
    out = {f.name: to_plain(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)
           if f.name not in ("name", "extras")}
    return {"name": recipe.name, **out, **{k: to_plain(v) for k, v in recipe.extras.items()}}


def save_recipe(recipe: Recipe, path) -> None:
    atomic_write_text(path, yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))


def dotted_settings(recipe: Recipe) -> dict:
    """Dotted scalar view (`train.lr: 0.0003`), for tracker hyperparameters and recipe comparison."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)

    walk("", recipe_to_dict(recipe))
    return out


register_section("experiment", ExperimentSection)
register_section("recovery", RecoverySection)

__all__ = [
    "ArmSection", "ExperimentSection", "ReferenceSection", "check_arm_name", "seeded_name", "setting", "require",
    "to_plain",
    "CountingOptions", "DataSection", "EvalSection", "ModelSection", "OutputSection", "PasskeyOptions",
    "PatchSection", "PeftSection", "Recipe", "RecoverySection",
    "ScheduleSection", "TrainSection", "apply_overrides", "build", "documentation", "documentation_markdown",
    "dotted_settings",
    "load_json", "load_recipe", "load_yaml", "read_yaml_file", "recipe_from_dict", "recipe_to_dict",
    "register_section", "resumed_recipe", "save_recipe",
]
