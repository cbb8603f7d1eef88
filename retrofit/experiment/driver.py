"""The retrofit experiment: one base checkpoint -> finetuned arms -> length evaluation -> report.

    retrofit experiment recipes/llama-avnorm-retrofit.yaml --out runs/smollm2
    retrofit demo                                   # recipes/demo.yaml: offline, CPU, minutes

1. Base: pretrain the recipe's model from its config with softmax attention (experiment.base_steps; its patch
   experiment.base_patch, e.g. a NoPE base), or take a pretrained source as it is (base_steps: 0).
2. Arms: from that one base, finetune each arm (its own `patch`) for the same steps, data and seed,
   evaluating at a schedule of finetune steps (the retrofit recovery curve).
3. Eval: the base and every arm at all extrapolation lengths (retrofit.evaluate).
4. Report: DIR/report.md with tables and plots, DIR/results.json, and the run folders.

Re-running the same command skips finished stages, so a crash in arm 3 does not redo the base.
This module runs the stages and keeps their books (what is finished, what resumes, whether a saved stage was trained
with the same settings); what they yield, the evaluation and results.json, is results.py. It owns no training or
evaluation logic.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import traceback
from pathlib import Path

from ..errors import RetrofitError, quoted
from ..evaluate.report import write_report
from ..io.atomic import atomic_write_text, check_output, output_folder, owned_folder, remove_owned
from ..io.readers import read_json
from ..load import load, training_dtype
from ..recipe import (
    ArmSection,
    ExperimentSection,
    PatchSection,
    Recipe,
    check_arm_name,
    dotted_settings,
    load_recipe,
    save_recipe,
    seeded_name,
)
from ..rope import describe_rope
from ..train import read_log, train
from ..train.recipe_fits import check_recipe_fits
from .reference import load_reference
from .report import hardware
from .results import arm_results, evaluate_all, within, write_results

DEMO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"

# ---- stages ------------------------------------------------------------------------------------------------------

def _finished(run_dir: Path) -> bool:
    return (run_dir / "result.json").is_file()


def _stage_recipe(recipe: Recipe, run_dir: Path, *, patch: PatchSection, steps: int, lr=None, warmup=None,
                  at_steps=(), source=None, recovery=None, lengths=None) -> Recipe:
    r = copy.deepcopy(recipe)
    r.extras = {} if recovery is None else {"recovery": copy.deepcopy(recovery)}
    r.patch = patch
    r.train = dataclasses.replace(r.train, steps=steps, lr=r.train.lr if lr is None else lr,
                                  warmup_steps=min(r.train.warmup_steps if warmup is None else warmup, steps))
    # stages evaluate at the recovery lengths (default: the training length); the long ones are retrofit.evaluate's
    r.eval = dataclasses.replace(r.eval, at_steps=sorted(set(at_steps)), every=0,
                                 lengths=sorted(set(lengths or [r.data.seq_len])))
    r.output = dataclasses.replace(r.output, dir=str(run_dir))
    if source is not None:
        r.model = dataclasses.replace(r.model, source=str(source), config=None)
    return r


def base_dir_of(out: Path, seed: int | None = None) -> Path:
    """DIR/base, or DIR/base-seedS for experiment.base_per_seed."""
    return out / ("base" if seed is None else f"base-seed{seed}")


def base_seeds(exp: ExperimentSection) -> list[int | None]:
    """The seeds a base is trained for: each of experiment.seeds with base_per_seed, else one base (None)."""
    return list(exp.seeds) if exp.base_per_seed else [None]


def run_base(recipe: Recipe, exp: ExperimentSection, out: Path, seed: int | None = None) -> str | None:
    """The base checkpoint every arm (of `seed`, with base_per_seed) starts from: a folder path, the recipe's
    pretrained source, or None (base_steps 0 with a config: every arm trains from scratch from the same seeded init)."""
    if exp.base_steps == 0:
        return recipe.model.source
    base_dir = base_dir_of(out, seed)
    if _finished(base_dir):
        print(f"[experiment] base: {base_dir} is finished, skipping")
        return str(base_dir)
    what = "softmax attention" if exp.base_patch.norm is None else \
        f"{exp.base_patch.norm}{' without positions' if exp.base_patch.nope else ''}"
    print(f"[experiment] base: training {exp.base_steps} steps with {what}"
          f"{'' if seed is None else f', seed {seed}'} -> {base_dir}")
    train(_base_stage(recipe, exp, out, seed), resume=base_dir.exists())
    return str(base_dir)


def _base_stage(recipe: Recipe, exp: ExperimentSection, out: Path, seed: int | None = None) -> Recipe:
    stage = _stage_recipe(recipe, base_dir_of(out, seed), patch=copy.deepcopy(exp.base_patch), steps=exp.base_steps)
    if seed is not None:  # its own init and data order
        stage.train = dataclasses.replace(stage.train, seed=seed)
    return stage


def check_base(recipe: Recipe, exp: ExperimentSection, out: Path) -> None:
    """Refuse, before DIR is written to, a base trained with other settings: every arm starts from it, so a changed
    base is a new experiment, not a resume."""
    for seed in base_seeds(exp) if exp.base_steps > 0 else []:
        base_dir = base_dir_of(out, seed)
        change = arm_change(base_dir, _base_stage(recipe, exp, out, seed), out)
        if change is not None:
            raise RetrofitError(f"{base_dir} was trained with other settings ({change}) and every arm starts from "
                                "it; pass a new --out, or restore the base's settings (experiment.base_steps, "
                                "base_patch)")


def run_arm(recipe: Recipe, exp: ExperimentSection, arm: ArmSection, base: str, out: Path) -> dict:
    """Finetune one arm from the base; returns {step: metrics} of its recovery evaluations."""
    check_arm_name(arm.name)  # again: an ArmSection can be changed after the recipe was checked
    arms = out / "arms"
    arm_dir = arms / arm.name
    recovery_file = arm_dir / "recovery.json"
    at = [s for s in exp.recovery_at if s <= exp.finetune_steps] + [exp.finetune_steps]
    stage = _stage_recipe(recipe, arm_dir, patch=arm.patch, steps=exp.finetune_steps,
                          lr=arm.lr if arm.lr is not None else exp.finetune_lr, warmup=exp.finetune_warmup,
                          at_steps=at, source=base, recovery=arm.recovery, lengths=exp.recovery_lengths)
    stage = arm.applied(stage)  # the arm's own seed (a replicate) and zero_init, all else the recipe's
    change = arm_change(arm_dir, stage, out)
    if change is not None:  # an edited arm: its old model (or checkpoints) would be reported under the new settings
        if not remove_owned(arm_dir, arms):
            raise RetrofitError(f"arm {arm.name}: {arm_dir} was trained with other settings ({change}) and was not "
                                "made by retrofit's experiment, so it is left as it is; move it away or restore "
                                "the arm's settings")
        print(f"[experiment] arm {arm.name}: its settings changed ({change}); training it again")
    elif _finished(arm_dir) and recovery_file.is_file():
        print(f"[experiment] arm {arm.name}: finished, skipping")
        return {int(k): v for k, v in read_json(recovery_file).items()}
    what = f"from {base}" if base else "from scratch"
    rope = f" + rope {describe_rope(arm.patch.rope)}" if arm.patch.rope is not None else ""
    print(f"[experiment] arm {arm.name}: {arm.patch.norm or 'unpatched'}{rope}, {exp.finetune_steps} steps {what} "
          f"-> {arm_dir}")
    # an arm that died before its first checkpoint starts over, if the folder is provably the one we made
    started = arm_dir.exists() and not (arm_dir / "checkpoints").is_dir() and not _finished(arm_dir)
    if started and remove_owned(arm_dir, arms):
        print(f"[experiment] arm {arm.name}: removed {arm_dir} (it died before its first checkpoint)")
    if not arm_dir.exists():
        owned_folder(arm_dir)
        resume = False
    else:
        resume = any(arm_dir.iterdir())
    # the base in the dtype the recipe trains in (model.dtype auto: float32 master weights, as load_base does)
    base_model = load(base, dtype=training_dtype(recipe.model.dtype)) if base else None
    result = train(stage, model=base_model, resume=resume)
    recovery = recovery_points(arm_dir) | {int(k): v for k, v in result.evals.items()}
    atomic_write_text(recovery_file, json.dumps(recovery, indent=1))
    return recovery


# Recipe keys that may differ between an arm's run and a re-run without changing the arm's model (its name, folder,
# logging, and the recovery-curve evaluations): the same ones a resume ignores (train/resume_state.py).
_SAME_MODEL = ("name", "output.", "train.progress", "train.log_every", "eval.")


def arm_change(arm_dir: Path, stage: Recipe, out: Path) -> str | None:
    """How a stage's recipe (an arm's, the base's) differs from the one its folder was trained with ('patch.p: 2.0 ->
    3.0'), or None when it does not or there is nothing to compare. The base is compared by its place in DIR, so a moved
    experiment folder still matches."""
    saved_path = arm_dir / "recipe.yaml"
    if not saved_path.is_file():
        return None
    try:
        saved = dotted_settings(load_recipe(saved_path))
    except RetrofitError as err:
        return f"its recipe.yaml no longer loads: {err}"
    current = dotted_settings(stage)
    saved_out = Path(str(saved.get("output.dir"))).parent.parent  # DIR/arms/NAME -> DIR, where it was trained
    for values, root in ((saved, saved_out), (current, out)):
        if isinstance(values.get("model.source"), str):
            values["model.source"] = within(values["model.source"], root)
    keys = sorted(k for k in set(saved) | set(current)
                  if not k.startswith(_SAME_MODEL) and saved.get(k) != current.get(k))
    if not keys:
        return None
    return ", ".join(f"{k}: {quoted(saved.get(k), 40)} -> {quoted(current.get(k), 40)}" for k in keys[:3]) + \
        (", ..." if len(keys) > 3 else "")


def recovery_points(run_dir: Path) -> dict[int, dict]:
    """{step: eval metrics} from the run's log.jsonl: the whole curve, also the points logged before the
    checkpoint a resumed run started from (its TrainResult holds only the evaluations it ran itself)."""
    log = run_dir / "log.jsonl"
    if not log.is_file():
        return {}
    return {int(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in read_log(log) if any(k.startswith("eval/") for k in r)}


def _recorded_times(out: Path) -> dict:
    """Stage wall times recorded when the stages ran (DIR/wall_time.json, else an earlier results.json)."""
    for path, key in ((out / "wall_time.json", None), (out / "results.json", "wall_time_s")):
        if path.is_file():
            data = read_json(path)
            return (data.get(key) if key else data) or {}
    return {}


class _Clock:
    """Per-stage wall time: measured for stages that run, as recorded for stages a re-run skips; saved
    after every stage so a crash does not lose the times of the stages before it."""

    def __init__(self, out: Path):
        self.out, self.recorded, self.times = out, _recorded_times(out), {}

    def stage(self, name: str, seconds: float, skipped: bool) -> None:
        self.times[name] = self.recorded.get(name, seconds) if skipped else seconds
        atomic_write_text(self.out / "wall_time.json", json.dumps(self.rounded()) + "\n")

    def rounded(self) -> dict:
        return {k: (round(v, 1) if v is not None else None) for k, v in self.times.items()}


def _one_line(err: Exception) -> str:
    """What the report says about a failed arm: the error's first line (with its type when unexpected)."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if not isinstance(err, RetrofitError):
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text[:300]


def run_experiment(recipe, out_dir, overrides=(), progress: bool = True) -> dict:
    """Run every stage that is not finished yet; returns the experiment results (also DIR/results.json)."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    exp = recipe.section("experiment")
    if exp is None:
        raise RetrofitError("this recipe has no experiment section (arms, base_steps, finetune_steps); "
                            "use `retrofit train` for a single run")
    check_recipe_fits(recipe)  # data, source, every arm's selections, memory: before DIR is made or written
    if "eval.lengths" in recipe.typed:  # the user's eval.lengths is honoured where it applies; say where it does not
        print(f"eval.lengths {recipe.eval_lengths()} is the final length evaluation; each stage's recovery curve is "
              f"measured at experiment.recovery_lengths {recipe.loop_eval_lengths()} (set that key to change it)")
    reference = load_reference(exp.reference, [a.name for a in exp.arms]) if exp.reference else None
    out = check_output(out_dir, "--out")  # new, empty or made by retrofit (a re-run resumes it)
    check_base(recipe, exp, out)  # before anything in it is touched, its lock included
    with output_folder(out, "--out") as out:  # locked: one experiment writes a folder at a time
        return _run_stages(recipe, exp, reference, out, progress)


def _run_stages(recipe, exp, reference, out: Path, progress: bool) -> dict:
    """run_experiment's stages, while the experiment folder is locked: base, arms, evaluation, report."""
    save_recipe(recipe, out / "recipe.yaml")
    clock, failures, recovery = _Clock(out), {}, {}
    start = time.perf_counter()
    bases = {}
    for seed in base_seeds(exp):
        skipped = exp.base_steps > 0 and _finished(base_dir_of(out, seed))
        bases[seed] = run_base(recipe, exp, out, seed)
        clock.stage(base_dir_of(out, seed).name, time.perf_counter() - start, skipped)
        start = time.perf_counter()
    runs = exp.runs()  # each arm, or each arm under each of experiment.seeds
    for arm in runs:
        base = bases[arm.seed if exp.base_per_seed else None]
        t0 = time.perf_counter()
        recovery_file = out / "arms" / arm.name / "recovery.json"
        before = recovery_file.stat().st_mtime_ns if _finished(recovery_file.parent) and recovery_file.is_file() \
            else None
        try:
            recovery[arm.name] = run_arm(recipe, exp, arm, base, out)
        except Exception as err:  # noqa: BLE001 -- a diverged (or crashed) arm is a result, not a crash of the experiment
            if not isinstance(err, RetrofitError):
                traceback.print_exc()
            failures[arm.name] = _one_line(err)
            print(f"[experiment] arm {arm.name} FAILED: {failures[arm.name]}")
        skipped = before is not None and recovery_file.is_file() and recovery_file.stat().st_mtime_ns == before
        clock.stage(f"arm {arm.name}", time.perf_counter() - t0, skipped)  # a retrained arm is not skipped
    t0 = time.perf_counter()
    done = [a.name for a in runs if a.name not in failures]
    labels = {seeded_name(a.name, s): {"arm": a.name, "seed": s} for a in exp.arms for s in exp.seeds or []}
    evaluated_base = {seed: b for seed, b in bases.items() if b and exp.eval_base}
    base_names = {seed: "base" if seed is None else seeded_name("base", seed) for seed in evaluated_base}
    labels |= {base_names[s]: {"arm": "base", "seed": s} for s in evaluated_base if s is not None}
    sources = list(evaluated_base.values()) + [str(out / "arms" / n) for n in done]
    names = list(base_names.values()) + done
    evaluation, reused = evaluate_all(sources, names, recipe, exp, progress, out, labels)
    write_report(evaluation, out / "eval")
    earlier = sum(m.get("eval_s") or 0 for m in evaluation["models"] if m["name"] in reused)  # their recorded times
    clock.stage("eval", time.perf_counter() - t0 + earlier, skipped=len(reused) == len(evaluation["models"]))
    results = {"schema": "retrofit.experiment/1", "recipe": recipe.name, "hardware": hardware(),
               "wall_time_s": clock.rounded(), "base": bases[None] if None in bases else bases,
               "arms": arm_results(out, runs, failures, recovery, labels),
               "control": exp.control, "seeds": exp.seeds, "evaluation": evaluation, "reference": reference}
    write_results(results, out)
    return results
