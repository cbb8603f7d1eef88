"""The committed demo report (docs/results/demo/report.md) is what `retrofit demo` makes now (issue 62, item 3): it
showed `gain=1.0` for the calibrated AVNorm arm while a fresh run says "calibrated on 8192 tokens", and docs say runs
print identical numbers. Without running the demo: each arm's label is built from the patch its recipe applies (a
model of the recipe's config, patched as the arm says, its calibration as the arm's run records it) through the
report's own labelling, and the lengths and recovery steps from the recipe; the committed report must show them.
Regenerate the committed report (`retrofit demo --out docs/results/demo`, alone on the CPU) when this fails."""

from __future__ import annotations

import json
from pathlib import Path

from retrofit.experiment.driver import DEMO_RECIPE
from retrofit.experiment.labels import trained_patch
from retrofit.load.from_recipe import apply_patch
from retrofit.load.models import model_from_config
from retrofit.patching import patch_record
from retrofit.recipe import load_recipe

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results" / "demo" / "report.md"


def _arm_label(recipe, arm, arm_dir: Path) -> str:
    """The report's patch column for `arm` as a run of the current recipe writes it (comparison_table's format)."""
    config = dict(recipe.model.config)
    model = model_from_config(config.pop("model_type"), **config)
    apply_patch(model, arm.patch)
    record = patch_record(model)
    tokens = arm.patch.tokens_to_calibrate(pretrained=True)  # every arm finetunes from the base: a pretrained model
    if tokens and record is not None:
        record["calibration"] = {"tokens": tokens}  # what calibrate() records of the run's calibration
    arm_dir.mkdir(parents=True)
    (arm_dir / "config.json").write_text(json.dumps({"retrofit": record}, sort_keys=True))  # as transformers saves
    (arm_dir / "result.json").write_text("{}")
    patch = trained_patch(arm_dir, arm)
    return ", ".join(f"{k}={v}" for k, v in patch.items() if v not in (None, False))


def test_the_committed_demo_report_matches_the_current_recipe(tmp_path):
    recipe = load_recipe(DEMO_RECIPE)
    exp = recipe.section("experiment")
    report = COMMITTED.read_text()
    labels = {arm.name: _arm_label(recipe, arm, tmp_path / arm.name) for arm in exp.arms}
    assert any("calibrated on" in label for label in labels.values())  # the demo has a calibrated arm
    missing = [f"| {name} | {label} |" for name, label in labels.items() if f"| {name} | {label} |" not in report]
    assert not missing, f"{COMMITTED} predates the recipe; rows expected now: {missing}"
    assert "gain=1.0" not in report
    lengths = recipe.eval.lengths
    header = "| model | patch | " + " | ".join(f"{n}{'*' if n == recipe.data.seq_len else ''}" for n in lengths)
    assert header in report
    steps = sorted({s for s in exp.recovery_at if s <= exp.finetune_steps} | {exp.finetune_steps})
    assert "| arm \\ finetune step | " + " | ".join(map(str, steps)) + " |" in report
