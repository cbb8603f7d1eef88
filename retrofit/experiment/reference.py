"""Compare an experiment with a published table: does each arm move the loss the same way the paper's did?

A recipe's `experiment.reference` names a JSON file of published losses by context length, e.g. the
AVnorm post's table (`context_lengths` plus curves, nested keys allowed):

    experiment:
      reference:
        file: data/reference/avnorm_full_attention_experiments.json
        control: pe.l1_baseline          # the published curve our control arm stands for
        arms: {avnorm: pe.rmsnorm}       # our arm -> its published curve
        note: nanogpt trained from scratch on FineWeb-Edu; finetuned steps 3000-4000

Absolute losses are not comparable across models and data, so the report compares directions only:
at each length both tables share, the arm's loss minus the control's, ours against theirs. The file
is read when the recipe runs (before any training), and its numbers are copied into results.json,
so the report can be rebuilt from results.json alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import RetrofitError
from ..io.escape import md_code, md_inline, md_text
from ..recipe import ReferenceSection


def _curve(table: dict, key: str, path: str) -> list[float]:
    node = table
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            keys = sorted(node) if isinstance(node, dict) else []
            raise RetrofitError(f"{path} has no curve {key!r} (at {part!r}; keys there: {', '.join(keys)})")
        node = node[part]
    if not isinstance(node, list) or not all(isinstance(x, (int, float)) for x in node):
        raise RetrofitError(f"{path}: {key!r} is not a list of numbers")
    return [float(x) for x in node]


def load_reference(ref: ReferenceSection, arm_names: list[str]) -> dict:
    """The published numbers this experiment is compared with, checked against the recipe's arms."""
    path = Path(ref.file)
    if not path.is_file():
        raise RetrofitError(f"experiment.reference.file {path} not found (paths are relative to the working directory)")
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RetrofitError(f"experiment.reference.file {path} is not valid JSON: {err}") from None
    lengths = table.get("context_lengths") if isinstance(table, dict) else None
    if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
        raise RetrofitError(f"{path} needs a top-level `context_lengths` list of integers")
    for arm in [ref.control_arm, *ref.arms]:
        if arm not in arm_names:
            raise RetrofitError(f"experiment.reference names arm {arm!r}, which is not among experiment.arms "
                                f"({', '.join(arm_names)})")
    curves = {"control": _curve(table, ref.control, path)} | {a: _curve(table, k, path) for a, k in ref.arms.items()}
    for name, values in curves.items():
        if len(values) != len(lengths):
            raise RetrofitError(f"{path}: curve for {name} has {len(values)} values for {len(lengths)} context_lengths")
    return {"file": str(path), "note": ref.note, "tie": ref.tie, "lengths": lengths,
            "control": {"arm": ref.control_arm, "key": ref.control, "values": curves["control"]},
            "arms": {a: {"key": k, "values": curves[a]} for a, k in ref.arms.items()}}


def _sign(x: float, tie: float) -> int:
    return 0 if abs(x) < tie else (1 if x > 0 else -1)


def directions(reference: dict, ours: dict[str, dict[int, float]]) -> dict[str, list[dict]]:
    """arm -> one row per shared length: our and the published difference (arm - control), and
    whether they point the same way (both within `tie` of zero counts as agreeing)."""
    control, tie = reference["control"], reference["tie"]
    theirs_control = dict(zip(reference["lengths"], control["values"]))
    out = {}
    for arm, curve in reference["arms"].items():
        theirs = dict(zip(reference["lengths"], curve["values"]))
        rows = []
        for n in sorted(set(theirs) & set(ours.get(arm, {})) & set(ours.get(control["arm"], {}))):
            mine, base = ours[arm][n], ours[control["arm"]][n]
            if mine is None or base is None or not math.isfinite(mine - base):
                continue
            d_ours, d_theirs = mine - base, theirs[n] - theirs_control[n]
            rows.append({"length": n, "ours": d_ours, "theirs": d_theirs,
                         "agree": _sign(d_ours, tie) == _sign(d_theirs, tie)})
        out[arm] = rows
    return out


def direction_markdown(reference: dict, ours: dict[str, dict[int, float]], train_len: int | None) -> list[str]:
    """The report's section: one table per compared arm, and a count of agreeing lengths."""
    control = reference["control"]
    lines = ["## Against the published table", "",
             f"Reference: {md_code(reference['file'])}"
             + (f" — {md_inline(reference['note'])}" if reference["note"] else "") + ".",
             "Losses of different models on different data are not comparable, so only directions are: "
             f"Δ = arm − {md_inline(control['arm'])} at the same length (reference: curve − "
             f"{md_code(control['key'])}); negative means the arm is better. |Δ| < {md_inline(reference['tie'])} "
             "counts as no difference.", ""]
    for arm, rows in directions(reference, ours).items():
        arm, key = md_text(arm), md_code(reference["arms"][arm]["key"])  # results.json's words: text
        if not rows:
            lines += [f"**{arm}** vs {key}: no length in common.", ""]
            continue
        agree = sum(r["agree"] for r in rows)
        lines += [f"**{arm}** vs {key}: same direction at {agree} of {len(rows)} shared lengths.", "",
                  f"| length | L / {md_inline(train_len or '—')} (our trained) | Δ ours | Δ published | direction |",
                  "|---|---|---|---|---|"]
        for r in rows:
            times = f"{r['length'] / train_len:g}" if train_len else "—"
            lines.append(f"| {r['length']} | {times} | {r['ours']:+.3f} | {r['theirs']:+.3f} | "
                         f"{'agrees' if r['agree'] else 'differs'} |")
        lines.append("")
    return lines
