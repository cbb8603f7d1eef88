"""The recipe's optional `experiment` section: one base -> finetuned arms -> evaluation -> report.

    experiment:
      base_steps: 0                       # 0 = the model as loaded
      finetune_steps: 100
      arms:
        - {name: softmax, patch: {norm: softmax}}
        - {name: avnorm, patch: {norm: avnorm, kind: rms}}
        - {name: avnorm-floor, patch: {norm: avnorm, kind: rms},
           recovery: {patch_lr: 1.0e-2, schedule: {steps: 60}}}   # an arm's own recovery (retrofit.recovery)
      recovery_lengths: [512, 4096]       # the recovery curve at these lengths
      reference: {file: avnorm_table.json, control: pe.l1_baseline, arms: {avnorm: pe.rmsnorm}}

`retrofit experiment` (retrofit/experiment/) runs it; the schema lives here so that a recipe loads
without importing the experiment driver.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..errors import RetrofitError
from .model import ZERO_INIT
from .recovery_section import RecoverySection
from .schema import setting
from .sections import PatchSection

# retrofit.norms.baseline_norm(), the model's own attention: the default control. Named here, not asked, so that this
# schema imports no torch (a recipe's keys are checked before torch loads); tests/recipe/test_recipe_yaml.py holds
# the two equal.
BASELINE_NORM = "softmax"

# An arm's name becomes a folder (DIR/arms/NAME): letters, digits and -_.+, not starting with a dot, so
# `..`, `.`, `a/b` or `.hidden` can never point outside DIR/arms or hide there.
ARM_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,99}")


def check_arm_name(name) -> None:
    if not isinstance(name, str) or not ARM_NAME.fullmatch(name) or name in ("base", "eval"):
        raise RetrofitError(f"experiment arm name {name!r} must be a folder name of letters, digits and -_.+ "
                            "not starting with a dot (and not base or eval), e.g. avnorm-rms")


def check_lr(value, key: str) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise RetrofitError(f"{key} must be a finite number > 0 (or null), got {value}")


@dataclass
class ReferenceSection:
    file: str = setting("", "JSON with `context_lengths` and the published loss curves (one per key)")
    control: str = setting("", "dotted key of the published curve our control arm stands for, e.g. pe.l1_baseline")
    control_arm: str = setting(BASELINE_NORM, "our arm compared against `control`")
    arms: dict[str, str] = setting(factory=dict,
                                   doc="our arm -> dotted key of its published curve, e.g. avnorm: pe.rmsnorm")
    note: str = setting("", "one line on what the reference measured (model, data, trained length, steps)")
    tie: float = setting(0.01, "differences smaller than this count as no difference in either table")

    def __post_init__(self):
        if not self.file or not self.control or not self.arms:
            raise RetrofitError("experiment.reference needs file, control and arms (our arm: published curve key)")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.arms.items()):
            raise RetrofitError("experiment.reference.arms must map arm names to curve keys (strings)")
        if self.tie < 0:
            raise RetrofitError("experiment.reference.tie must be >= 0")


@dataclass
class ArmSection:
    name: str = setting("arm", "folder and label of the arm, e.g. softmax, avnorm-rms, psoftmax-p2")
    patch: PatchSection = setting(factory=PatchSection, doc="the arm's attention patch; norm softmax = the control")
    lr: float | None = setting(None, "finetune learning rate of this arm; null = experiment.finetune_lr")
    seed: int | None = setting(None, "this arm's train.seed (its data order, and its init when it trains from "
                                     "scratch): arms that differ only in seed replicate one; null = train.seed")
    recovery: RecoverySection | None = setting(None, "this arm's recovery (schedule, distillation, patch_lr; see the "
                                                     "recovery section); null = plain finetune. The top-level recovery "
                                                     "section is not applied to arms: each arm says its own")
    zero_init: list[str] | None = setting(None, "from scratch: this arm's model.zero_init (attention_output, "
                                                "mlp_output; [] = none), e.g. to ablate it; null = model.zero_init")

    def __post_init__(self):
        check_arm_name(self.name)
        check_lr(self.lr, f"experiment arm {self.name} lr")
        for part in self.zero_init or []:
            if part not in ZERO_INIT:
                raise RetrofitError(f"experiment arm {self.name} zero_init: unknown part {part!r}; choose from "
                                    f"{', '.join(ZERO_INIT)}")

    def applied(self, stage):
        """`stage` (the arm's Recipe) with what this arm sets itself: its seed (a replicate: its own data order, and
        init from scratch) and its zero_init."""
        if self.seed is not None:
            stage.train = dataclasses.replace(stage.train, seed=self.seed)
        if self.zero_init is not None:
            stage.model = dataclasses.replace(stage.model, zero_init=list(self.zero_init))
        return stage


@dataclass
class ExperimentSection:
    arms: list[ArmSection] = setting(factory=list, doc="the finetune arms, all from the same base")
    base_steps: int = setting(0, "steps to (pre)train the base with softmax attention; 0 = the model as loaded "
                                  "(with model.config: no base, every arm trains from the same seeded init)")
    base_patch: PatchSection = setting(factory=PatchSection,
                                       doc="the patch the base pretrains with; unset = softmax with the model's "
                                           "positions (a NoPE base: {norm: softmax, nope: true}, the AVnorm post's "
                                           "NoPE runs)")
    base_per_seed: bool = setting(False, "with seeds and base_steps > 0: pretrain one base per seed (DIR/base-seedS, "
                                          "train.seed = S) and finetune that seed's arms from it, so a seed replicates "
                                          "the whole pipeline, not only the finetunes; false: one base for all seeds")
    eval_base: bool = setting(True, "evaluate the base next to the arms; false skips it (e.g. a pretrained base "
                                    "measured elsewhere: one model fewer at every length)")
    finetune_steps: int = setting(100, "optimizer steps of every arm")
    finetune_lr: float | None = setting(None, "arms' learning rate; null = train.lr")
    finetune_warmup: int | None = setting(None, "arms' warmup steps; null = train.warmup_steps")
    recovery_at: list[int] = setting(factory=lambda: [0, 10, 20, 50, 100, 200, 500, 1000],
                                     doc="finetune steps at which each arm is evaluated at the training length "
                                         "(clipped to finetune_steps): the recovery curve")
    recovery_lengths: list[int] | None = setting(None, "lengths the recovery curve is measured at (the first "
                                                       "eval.batches validation blocks, cut); null = [data.seq_len]")
    control: str = setting(BASELINE_NORM, "the arm every other arm's recovery gap is measured against; an experiment "
                                      "without an arm of that name reports no gaps")
    seeds: list[int] | None = setting(None, "training seeds: every arm is finetuned once per seed "
                                            "(DIR/arms/NAME-seedS, train.seed = S), all scored on the same windows; "
                                            "reports give each arm's mean over seeds and its paired difference to the "
                                            "control with intervals over seeds. The base is trained once. null = one "
                                            "run per arm")
    eval_data: list[str] | None = setting(None, "lm: text (or .json token) files for the length evaluation")
    eval_max_tokens: int | None = setting(None, "lm: cap on tokens evaluated per length (null = all windows)")
    eval_sequences: int | None = setting(None, "counting: generated sequences per evaluation length (the units of its "
                                               "intervals); null = evaluate_counting's default, 8")
    eval_prefixes: bool = setting(False, "counting: score every evaluation length as a prefix of the same sequences "
                                         "of the longest length (the L2 post's evaluation: one forward at the "
                                         "longest, every prefix boundary scored); false = separate sequences per "
                                         "length")
    eval_variants: list[dict] | None = setting(None, "evaluate every model once per variant {name, rope}, e.g. "
                                                     "[{name: raw}, {name: yarn4, rope: 'yarn:4,original=256'}]: "
                                                     "entries NAME+VARIANT, each arm compared with the control under "
                                                     "the same variant (a norm that owns the logits' temperature, "
                                                     "SSMax, gets YaRN's attention factor 1); null = as trained")
    train_len: int | None = setting(None, "the length marked as 'trained' in the report; null = data.seq_len")
    reference: ReferenceSection | None = setting(None, "a published loss table to compare directions with "
                                                       "(retrofit.experiment.reference): file, control, arms, note")

    def __post_init__(self):
        if not self.arms:
            raise RetrofitError("experiment.arms is empty: list at least one arm "
                                "(e.g. name: softmax, patch: {norm: softmax})")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise RetrofitError(f"experiment.arms has duplicate names: {names}")
        self._check_seeds(names)
        if self.base_steps < 0 or self.finetune_steps < 1:
            raise RetrofitError("experiment.base_steps must be >= 0 and finetune_steps >= 1")
        check_lr(self.finetune_lr, "experiment.finetune_lr")
        if self.base_patch.norm is not None and self.base_steps == 0:
            raise RetrofitError("experiment.base_patch applies to a base pretrained here: set experiment.base_steps "
                                "> 0, or remove base_patch (the arms' own patch applies to a loaded base)")
        if self.base_per_seed and (self.seeds is None or self.base_steps == 0):
            raise RetrofitError("experiment.base_per_seed trains one base per seed: set experiment.seeds and "
                                "base_steps > 0, or remove base_per_seed")
        self.eval_variants = check_eval_variants(self.eval_variants)
        if self.eval_sequences is not None and self.eval_sequences < 1:
            raise RetrofitError(f"experiment.eval_sequences must be >= 1 (or null), got {self.eval_sequences}")
        if self.recovery_lengths is not None and not (self.recovery_lengths
                                                      and all(isinstance(n, int) and n >= 2
                                                              for n in self.recovery_lengths)):
            raise RetrofitError(f"experiment.recovery_lengths must be a non-empty list of lengths >= 2, "
                                f"got {self.recovery_lengths}")

    def check_recipe(self, recipe) -> None:
        """An arm's own zero_init initializes a model built from model.config, with no base: refused otherwise."""
        own = [a.name for a in self.arms if a.zero_init]
        if own and (recipe.model.source is not None or self.base_steps > 0):
            raise RetrofitError(f"experiment arm {own[0]} sets zero_init, which initializes a model built from "
                                "model.config; these arms start from a base (model.source or experiment.base_steps): "
                                "drop the arm's zero_init")

    def _check_seeds(self, names: list[str]) -> None:
        if self.seeds is None:
            return
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.seeds) \
                or len(set(self.seeds)) != len(self.seeds):
            raise RetrofitError(f"experiment.seeds must be a non-empty list of distinct integers >= 0 (or null), "
                                f"got {self.seeds}")
        own = [a.name for a in self.arms if a.seed is not None]
        if own:
            raise RetrofitError(f"experiment arm {own[0]} sets its own seed and experiment.seeds is set: remove one "
                                "(experiment.seeds runs every arm under every seed)")
        runs = [seeded_name(n, s) for n in names for s in self.seeds]
        if len(set(runs) | set(names)) != len(runs) + len(names):
            raise RetrofitError(f"experiment.seeds: an arm's run name is also an arm's name ({', '.join(names)}); "
                                "rename the arm")

    def runs(self) -> list[ArmSection]:
        """The arms as they are trained: each arm once, or with seeds each arm once per seed (seed-major, so every
        arm has its first seed before any has its second), named NAME-seedS with `seed` set."""
        if self.seeds is None:
            return list(self.arms)
        return [dataclasses.replace(arm, name=seeded_name(arm.name, s), seed=s) for s in self.seeds
                for arm in self.arms]


def check_eval_variants(variants) -> list[dict] | None:
    """experiment.eval_variants checked before anything trains: a list of {name, rope}, names unique folder-safe
    words (they become NAME+VARIANT), every rope one retrofit.rope reads."""
    if variants is None:
        return None
    if not isinstance(variants, list) or not variants:
        raise RetrofitError("experiment.eval_variants must be a non-empty list like [{name: raw}, {name: yarn4, rope: "
                            "'yarn:4,original=256'}] (or null)")
    names = []
    for i, v in enumerate(variants):
        if not isinstance(v, dict) or set(v) - {"name", "rope"} or not isinstance(v.get("name"), str) \
                or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", v["name"]):
            raise RetrofitError(f"experiment.eval_variants[{i}] must be {{name: WORD, rope: TYPE:FACTOR,...}} with a "
                                f"name of letters, digits, - and _ (rope optional), got {v!r}")
        if v.get("rope") is not None:
            from ..rope import normalize_rope  # torch: not imported before a recipe's keys are checked
            normalize_rope(v["rope"])  # a bad rope fails here, not after the training
        names.append(v["name"])
    if len(set(names)) != len(names):
        raise RetrofitError(f"experiment.eval_variants has duplicate names: {names}")
    return [dict(v) for v in variants]


def seeded_name(arm: str, seed: int) -> str:
    """The run (folder and evaluation name) of `arm` under training seed `seed`."""
    return f"{arm}-seed{seed}"

