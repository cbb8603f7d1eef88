"""Paired differences to a reference model: the comparison users make ("is B better than A at 16K?").

    results["comparisons"] = paired_comparisons(results, reference="dynamic4")
    results["comparisons"] = paired_comparisons(results, reference="dynamic4,yarn4")   # to each, rows say which

Two models scored on the same windows (equal `windows_sha1`) are compared window by window: the difference of
their mean losses with a t interval over the per-window differences (retrofit.evaluate.intervals), which removes
the variation between windows that both models share (a hard window is hard for both). Models on different windows
get the difference of their means only, with no interval and the reason.
"""

from __future__ import annotations

import numpy as np

from ..errors import RetrofitError
from .intervals import as_list, covers_zero, equivalent, mean_interval
from .seeds import seed_summary


def check_references(reference, names: list[str], arms: dict[str, str] | None = None) -> list[str]:
    """The references' names: None = the first model; a name, a comma list 'a,b' or a list of names, each one of
    the models (else a one-line error). With `arms` (model name -> arm, an experiment with seeds), an arm's name
    stands for its run under every seed. Empty when there are no models."""
    if reference is None:
        return names[:1]
    wanted = [r.strip() for r in reference.split(",")] if isinstance(reference, str) else list(reference)
    runs = {}
    for name, arm in (arms or {}).items():
        runs.setdefault(arm, []).append(name)
    found = []
    for name in wanted:
        if name not in names and name not in runs:
            raise RetrofitError(f"--reference {name} is not one of the models: {', '.join(names)}")
        found += [name] if name in names else runs[name]
    return list(dict.fromkeys(found))


def model_arms(results: dict) -> dict[str, str]:
    """model name -> arm, for the entries of an experiment with seeds (retrofit.evaluate.seeds)."""
    return {m["name"]: m["arm"] for m in results["models"] if m.get("arm") is not None and m.get("seed") is not None}


def paired_comparisons(results: dict, reference=None, margin: float | None = None) -> dict | None:
    """{"reference": FIRST, "references": [NAME, ...], "rows": [...]}: for each reference, one row per (other model,
    length both have), or None when fewer than two models have language-modelling rows. Each row: reference,
    model, length, difference (model - reference mean loss), ci95, windows, covers_zero, paired, and a reason
    when not paired. `reference`: None (the first model), a name, 'a,b' or a list of names (an arm's name: its run
    under every seed). Two runs trained under different seeds are not compared (each is, with its own seed's).
    margin: the equivalence margin (nats); each paired row says whether its difference is within it (`equivalent`)."""
    names = [m["name"] for m in results["models"]]
    references = check_references(reference, names, model_arms(results))
    by_name = {m["name"]: {r["length"]: r for r in m.get("lengths") or []} for m in results["models"]}
    seeds = {m["name"]: m.get("seed") for m in results["models"]}
    if not references or sum(1 for rows in by_name.values() if rows) < 2:
        return None
    rows = []
    for ref in references:
        for name in names:
            if name == ref or None not in (seeds[name], seeds[ref]) and seeds[name] != seeds[ref]:
                continue  # runs under other training seeds are compared within their own seed only
            for length, row in by_name[name].items():
                base = by_name[ref].get(length)
                if base is not None:
                    rows.append({"reference": ref, "model": name, "length": length,
                                 **paired_row(row, base, margin)})
    return {"reference": references[0], "references": references, "rows": rows}


def comparison_references(results: dict) -> list[str]:
    """The references of results['comparisons'] in order (results with one reference name only that one)."""
    comparisons = results.get("comparisons") or {}
    return comparisons.get("references") or ([comparisons["reference"]] if comparisons.get("reference") else [])


def paired_row(row: dict, base: dict, margin: float | None = None) -> dict:
    """difference, ci95, windows, covers_zero, paired (and reason) of one length row against the reference's; with a
    margin, whether the difference is shown to lie within it (`equivalent`, two one-sided tests)."""
    difference = row["loss"] - base["loss"]
    reason = None
    if not row.get("windows_sha1") or row.get("windows_sha1") != base.get("windows_sha1"):
        reason = "different windows (windows_sha1 differs or is missing): no paired interval"
    elif "window_losses" not in row or "window_losses" not in base:
        reason = "no per-window losses (results written before intervals): no paired interval"
    if reason:
        return {"difference": difference, "ci95": None, "windows": row["windows"], "covers_zero": None,
                "paired": False, "reason": reason}
    diffs = np.asarray(row["window_losses"], dtype=np.float64) - np.asarray(base["window_losses"], dtype=np.float64)
    ci95 = as_list(mean_interval(diffs))
    return {"difference": float(diffs.mean()), "ci95": ci95, "windows": int(diffs.size),
            "covers_zero": covers_zero(ci95), "paired": True} | \
        ({"equivalent": equivalent(diffs, margin)} if margin is not None else {})


def judged(results: dict, reference=None, margin: float | None = None) -> dict:
    """`results` with its paired differences to `reference` (see paired_comparisons) and, for an experiment with
    seeds, its summary over seeds (`seeds`, retrofit.evaluate.seeds; the control is the first reference's arm)
    computed afresh from the stored per-window losses; stale ones dropped. An unknown reference is a one-line error.
    margin: the equivalence margin in nats (None: the one settings.equivalence_margin declares, if any), kept there."""
    results = {k: v for k, v in results.items() if k not in ("comparisons", "seeds")}
    margin = margin if margin is not None else (results.get("settings") or {}).get("equivalence_margin")
    if margin is not None:
        results["settings"] = {**(results.get("settings") or {}), "equivalence_margin": margin}
    comparisons = paired_comparisons(results, reference, margin)
    arms = model_arms(results)
    references = check_references(reference, [m["name"] for m in results["models"]], arms)
    summary = seed_summary(results, next((arms[r] for r in references if r in arms), None), margin)
    return results | ({"schema": "retrofit.eval/2", "comparisons": comparisons} if comparisons else {}) \
        | ({"seeds": summary} if summary else {})


def with_comparisons(evaluation: dict, reference) -> dict:
    """`evaluation` judged (see judged) against `reference` (a model or an arm: the experiment's control) when it
    is one of its models or arms, else the first model. Entries reused from before intervals are compared unpaired."""
    known = reference in [m["name"] for m in evaluation["models"]] or reference in model_arms(evaluation).values()
    return judged(evaluation, reference if known else None)
