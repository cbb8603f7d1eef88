"""Training seeds as a unit: each arm's mean over seeds, and its paired difference to the control over seeds.

    results["seeds"] = seed_summary(results, control="softmax")

An experiment with `experiment.seeds: [0, 1, 2]` trains every arm once per seed; its evaluation entries carry `arm`
and `seed` (retrofit.experiment.driver), and every run is scored on the same windows. One seed is one unit: within a
seed the windows are averaged (a window is not independent of the seed's training run), then the t interval
(retrofit.evaluate.intervals.mean_interval) is taken over the per-seed values. The paired difference of an arm to
the control is formed within each seed, window by window on the same windows (their mean difference), then
over seeds: it answers "would another training seed give the same sign?", which windows alone cannot.
"""

from __future__ import annotations

import numpy as np

from .intervals import as_list, covers_zero, equivalent, mean_interval


def seed_groups(results: dict) -> dict[str, dict[int, dict]]:
    """arm -> {seed: model entry} for the entries that carry both (an experiment with seeds); empty otherwise."""
    groups: dict[str, dict[int, dict]] = {}
    for m in results["models"]:
        if m.get("arm") is not None and m.get("seed") is not None:
            groups.setdefault(m["arm"], {})[int(m["seed"])] = m
    return groups


def controls(results: dict, control: str | None) -> dict[str, str | None]:
    """arm -> the arm it is compared with: `control`; or, with evaluation variants (entries carrying `variant` and
    `trained_as`, arms named ARM+VARIANT: an experiment's eval_variants), the control's trained arm under the arm's
    own variant, so every arm under YaRN is judged against the control under YaRN, never against the raw control."""
    info = {m["arm"]: (m.get("trained_as"), m.get("variant")) for m in results["models"] if m.get("arm") is not None}
    if control not in info or info[control][1] is None:
        return {arm: control for arm in info}
    trained = info[control][0]
    by_variant = {variant: arm for arm, (t, variant) in info.items() if t == trained}
    return {arm: by_variant.get(variant) for arm, (_, variant) in info.items()}


# what a model's rows hold, by task: (rows key, the metric, its per-unit values, the count of units)
METRICS = {"lengths": ("loss", "window_losses", "windows"), "counting": ("l1", "sequence_l1", "sequences")}


def _task(results: dict) -> str:
    """Counting runs are summarized by L1 over sequences, language models by loss over windows."""
    return "counting" if any(m.get("counting") for m in results["models"]) else "lengths"


def _paired(row: dict, base: dict, task: str) -> float | None:
    """One seed's paired difference at one length: the mean of the per-unit differences (the same windows, or
    the same generated counting sequences); None when the units are not the same, so nothing pairs."""
    metric, units, _ = METRICS[task]
    if task == "lengths" and (not row.get("windows_sha1") or row.get("windows_sha1") != base.get("windows_sha1")):
        return None
    if units in row and units in base and len(row[units]) == len(base[units]):
        return float(np.mean(np.subtract(row[units], base[units])))
    return row[metric] - base[metric] if task == "lengths" else None


def seed_summary(results: dict, control: str | None, margin: float | None = None) -> dict | None:
    """{"control", "seeds", "metric", "arms": [...], "differences": [...]}: per (arm, length), the mean metric (loss,
    or counting L1) over seeds with its interval over seeds (`seeds` = n, `seed_values` in `seed_list` order, `units`
    per seed); per (arm other than the control, length), the difference to the control formed within each seed on
    the same units, then its mean and interval over the seeds both ran (`seed_differences`); with a margin (nats of
    loss; counting L1 has none), whether it lies within it over seeds (`equivalent`). None when no entry carries a
    seed."""
    groups, task = seed_groups(results), _task(results)
    if not groups:
        return None
    metric, _, count = METRICS[task]
    arms, differences, compared_with = [], [], controls(results, control)
    for arm, by_seed in groups.items():
        against = compared_with.get(arm)
        rows = {s: {r["length"]: r for r in entry.get(task) or []} for s, entry in sorted(by_seed.items())}
        for length in sorted({n for r in rows.values() for n in r}):
            have = {s: r[length] for s, r in rows.items() if length in r}
            values = [row[metric] for row in have.values()]
            arms.append({"arm": arm, "length": length, "value": float(np.mean(values)),
                         "ci95": as_list(mean_interval(values)), "seeds": len(values), "seed_list": list(have),
                         "seed_values": values, "units": next(iter(have.values()))[count]})
            if against is None or arm == against or against not in groups:
                continue
            base = {s: {r["length"]: r for r in e.get(task) or []}.get(length) for s, e in groups[against].items()}
            paired = {s: _paired(row, base[s], task) for s, row in have.items() if base.get(s) is not None}
            paired = {s: d for s, d in paired.items() if d is not None}
            if paired:
                interval = as_list(mean_interval(list(paired.values())))
                differences.append({"arm": arm, "length": length, "difference": float(np.mean(list(paired.values()))),
                                    "ci95": interval, "seeds": len(paired), "covers_zero": covers_zero(interval),
                                    "seed_list": list(paired), "seed_differences": list(paired.values())}
                                   | ({"equivalent": equivalent(list(paired.values()), margin)}
                                      if margin is not None and task == "lengths" else {})
                                   | ({"against": against} if against != control else {}))
    variant_controls = {a: c for a, c in compared_with.items() if a in groups and c is not None and c != control}
    return {"control": control, **({"controls": variant_controls} if variant_controls else {}),
            "seeds": sorted({s for g in groups.values() for s in g}), "metric": metric,
            "arms": arms, "differences": differences}
