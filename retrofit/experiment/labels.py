"""An arm's label in the experiment's report: the patch its checkpoint recorded (what was trained: p at the end of a
schedule, the rope it ran with, a selective patch's layers and heads), not only what the recipe asked for."""

from __future__ import annotations

from pathlib import Path

from ..io.readers import read_json
from ..norms import NORMS
from ..recipe import ArmSection
from ..rope import normalize_rope


def trained_patch(arm_dir: Path, arm: ArmSection) -> dict:
    """The arm's patch as its checkpoint records it (config.retrofit: what was trained, e.g. p at the end of a
    schedule), for the report's labels; the recipe's settings when there is no checkpoint (a failed arm)."""
    config = arm_dir / "config.json"
    if not (config.is_file() and (arm_dir / "result.json").is_file()):
        spec = arm.patch.spec()
        found = arm.patch.options | {"norm": arm.patch.norm, "nope": arm.patch.nope, "rope": arm.patch.rope,
                                     "layers": arm.patch.layers, "heads": arm.patch.heads,
                                     "gate": spec.gate if spec else None}
    elif not isinstance(record := read_json(config).get("retrofit"), dict):
        return {"norm": None, "nope": False}  # an arm left unpatched
    else:
        found = _trained_options(record) | {k: record.get(k) for k in ("norm", "layers", "heads", "gate")} | {
            "nope": bool(record.get("nope")),
            "rope": _trained_rope(record["rope"], arm.patch.rope) if record.get("rope") is not None else None}
    return {k: v for k, v in found.items() if v is not None or k not in ("rope", "layers", "heads", "gate")}


def _trained_options(record: dict) -> dict:
    """The recorded options as a PatchReport shows them: a calibrated one (AVNorm's gain) says it was calibrated,
    not the start value the option holds; the options that only start a parameter are left out."""
    options = dict(record.get("options") or {})
    if record.get("norm") not in NORMS:
        return options
    hidden, calibrated = NORMS[record["norm"]].report_options(options)
    shown = {k: v for k, v in options.items() if k not in hidden or k == calibrated}
    if calibrated and isinstance(record.get("calibration"), dict):
        shown[calibrated] = f"calibrated on {record['calibration'].get('tokens')} tokens"
    return shown


def _trained_rope(plan: dict, written):
    """The rope a checkpoint was trained with, as the recipe wrote it ('yarn:4') when the two agree (every key the
    recipe set has the trained value; the plan adds what the model filled in, such as the original positions),
    else the checkpoint's own parameters."""
    trained = plan.get("parameters", plan) if isinstance(plan, dict) else plan
    if written is None or not isinstance(trained, dict):
        return trained
    agree = all(k in trained and trained[k] == v for k, v in normalize_rope(written).items())  # values may be lists
    return written if agree else trained
