"""From per-(layer, head) arrays to the JSON result: every head's numbers plus summaries across heads.

The result of one model, as written to diagnose.json:

    per_head   {key: [[value per head] per layer]}, means over rows and windows: keys "L/entropy",
               "L/dist/true/N", "L/sep/ratio/N", "grad/eps/T" (the max over rows is summarized only)
    summary    vanishing / variance / distance / separability / gradient: medians across heads, the
               KS critical N per length, the separability plateau, the 1/T slope
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..norms import NORMS, baseline_norm
from . import measures
from .collect import Accumulator, Plan

# How each measure is read for each normalization (written into the report) is the norm's own `diagnosis`
# (retrofit/norms/*): measures 3 and 4 (Theorems 1 and 2) take any weights as they are; where a norm changes the
# reading of 1, 2 or 5 its diagnosis says so.


def _round(a, digits=5):
    """(layers, H) array -> nested lists of floats with `digits` significant digits (None for nan/inf)."""
    return [[float(f"{v:.{digits}g}") if math.isfinite(v) else None for v in row] for row in np.asarray(a, float)]


def _clean(obj):
    """nan/inf -> None and numpy scalars -> floats, so diagnose.json is strict JSON."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _median(a) -> float:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return float(np.median(a)) if a.size else math.nan


def _mean(a) -> float:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def _quantiles(a, qs=(0.1, 0.25, 0.5, 0.75, 0.9)) -> list[float]:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return [float(np.quantile(a, q)) for q in qs] if a.size else [math.nan] * len(qs)


def summarize(acc: Accumulator, plan: Plan, meta: dict) -> dict:
    """The JSON result for one model: meta (label, source, norm...) + per_head + summary."""
    per_head = {k: _round(acc.mean(k)) for k in sorted(acc.sums) if _per_head_key(k, plan)}
    vanishing, variance = _vanishing_and_variance(acc, plan)
    separability = _separability(acc, plan)
    summary = {"vanishing": vanishing, "variance": variance, "by_layer": _by_layer(acc, plan, separability),
               "distance": _distance(acc, plan), "separability": separability, "gradient": _gradient(acc, plan)}
    norm = NORMS.get(meta.get("norm") or baseline_norm())
    reading = norm.diagnosis if norm is not None else ""
    return {**meta, "generalization": reading, "layers": acc.shape[0], "heads": acc.shape[1],
            "lengths": plan.lengths, "queries": {L: q for L, (_, q) in plan.rows_by_length.items()},
            "summary": _clean(summary), "per_head": per_head}


def _per_head_key(key: str, plan: Plan) -> bool:
    """Whether `key` goes into per_head: the KS search's extra N values stay out (summarized in distance), and
    so does cor1_holds (a theorem: 1 everywhere; summary.vanishing keeps the fraction)."""
    parts = key.split("/")
    if parts[-1] == "cor1_holds":
        return False
    return not (len(parts) == 4 and parts[1] == "dist" and int(parts[3]) not in plan.figure_ns(int(parts[0])))


def _vanishing_and_variance(acc: Accumulator, plan: Plan) -> tuple[dict, dict]:
    """Measures 1 and 2 per length: medians across heads of the row statistics, Corollary 1's use of its bounds,
    and the head-output variance against its prediction."""
    vanishing, variance = {}, {}
    for L in plan.lengths:
        m = {k: acc.mean(f"{L}/{k}") for k in ("entropy", "max_weight", "min_weight", "sq_norm", "mass",
                                                "cor1_exponent", "cor1_holds", "cor1_upper_use", "cor1_lower_use",
                                                "logit_range", "var_pred", "var_value", "var_out_raw", "var_out")}
        vanishing[L] = {"log_L": math.log(L), "entropy": _median(m["entropy"]), "entropy_mean": _mean(m["entropy"]),
                        "inv_L": 1 / L, "max_weight": _median(m["max_weight"]), "min_weight": _median(m["min_weight"]),
                        "mass": _median(m["mass"]),
                        "cor1_exponent": _median(m["cor1_exponent"]), "cor1_holds": _mean(m["cor1_holds"]),
                        "cor1_upper_use": _median(m["cor1_upper_use"]), "cor1_lower_use": _median(m["cor1_lower_use"]),
                        "logit_range": _median(m["logit_range"])}
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = m["var_out_raw"] / m["var_pred"]
        variance[L] = {"sq_norm": _median(m["sq_norm"]), "var_value": _median(m["var_value"]),
                       "var_pred": _median(m["var_pred"]), "var_out_raw": _median(m["var_out_raw"]),
                       "var_out": _median(m["var_out"]), "measured_over_pred": _median(ratio)}
    return vanishing, variance


def _distance(acc: Accumulator, plan: Plan) -> dict:
    """Measure 3 (Theorem 1): the top-N distance by length at distance_n and by N at the largest length, and the
    KS critical N per length (against the printed and the exact expectation)."""
    Lmax = plan.lengths[-1]

    def row(L, N):
        keys = ("true", "expected", "eps", "expected_printed", "bound")
        return {k: _median(acc.mean(f"{L}/dist/{k}/{N}")) for k in keys}

    critical = {}
    for L in plan.lengths:
        ns = plan.ks_ns(L)
        true = {N: acc.mean(f"{L}/dist/true/{N}") for N in ns}
        critical[L] = {}
        for name, key in (("printed", "expected_printed"), ("exact", "expected")):
            n_crit, pvalues = measures.critical_n(true, {N: acc.mean(f"{L}/dist/{key}/{N}") for N in ns},
                                                  plan.ks_alpha)
            critical[L][name] = {"critical_n": n_crit, "fraction": None if n_crit is None else n_crit / L,
                                 "pvalues": {N: round(p, 6) for N, p in pvalues.items()}}

    def median_fraction(name):
        return _median([c[name]["fraction"] for c in critical.values() if c[name]["fraction"] is not None])

    return {"n": plan.distance_n, "length": Lmax,
            "by_length": {L: row(L, plan.distance_n) for L in plan.lengths if plan.distance_n in plan.figure_ns(L)},
            "by_n": {N: row(Lmax, N) for N in plan.figure_ns(Lmax)},
            "critical": critical, "critical_fraction_printed": median_fraction("printed"),
            "critical_fraction_exact": median_fraction("exact")}


def _separability(acc: Accumulator, plan: Plan) -> dict:
    """Measure 4 (Theorem 2) at the largest length: N_s / N quantiles and bounds per N, and the plateau (the mean
    median ratio over N >= 16)."""
    Lmax = plan.lengths[-1]
    by_n = {}
    for N in plan.usable(Lmax, plan.separability_ns):
        ratio = acc.mean(f"{Lmax}/sep/ratio/{N}")
        by_n[N] = {"ratio_quantiles": _quantiles(ratio), "ratio_mean": _mean(ratio),
                   "lower": _mean(acc.mean(f"{Lmax}/sep/lower/{N}")),
                   "upper": _mean(acc.mean(f"{Lmax}/sep/upper/{N}")),
                   "upper_holds": _mean(acc.mean(f"{Lmax}/sep/upper_holds/{N}"))}
    big = [N for N in by_n if N >= 16]
    plateau = _mean([by_n[N]["ratio_quantiles"][2] for N in big]) if big else math.nan
    return {"length": Lmax, "by_n": by_n, "plateau": plateau, "plateau_ns": big}


def _gradient(acc: Accumulator, plan: Plan) -> dict:
    """Measure 5 (Corollary 3): g(T, eps) max and median across heads per temperature, the paper's bound, and
    the log-log slope at small T."""
    temps = list(plan.temperatures)
    gradient = {"temperatures": temps, "length": plan.lengths[-1],
                "paper_bound": [float(b) for b in measures.corollary3_bound(temps)],
                "sup_bound": [1 / (2 * t) for t in temps], "by_eps": {}}
    small = [i for i, t in enumerate(temps) if t <= 0.1]
    for eps in plan.epsilons:
        gmax = [float(np.nanmax(acc.max(f"grad/{eps:g}/{t:.6g}"))) for t in temps]
        gmed = [_median(acc.mean(f"grad/{eps:g}/{t:.6g}")) for t in temps]
        gradient["by_eps"][f"{eps:g}"] = {
            "max": gmax, "median": gmed,
            "slope_small_T_max": measures.loglog_slope([temps[i] for i in small], [gmax[i] for i in small]),
            "slope_small_T_median": measures.loglog_slope([temps[i] for i in small], [gmed[i] for i in small]),
            "above_paper_bound": int(sum(g > b * (1 + 1e-6) for g, b in zip(gmax, gradient["paper_bound"]))),
        }
    return gradient


def _by_layer(acc: Accumulator, plan: Plan, separability: dict) -> dict:
    """Per layer at the largest length: means over that layer's heads (an all-nan layer stays nan)."""
    Lmax = plan.lengths[-1]
    sep_n = max([N for N in separability["by_n"] if N <= 16], default=None)
    layer_keys = {"entropy": f"{Lmax}/entropy", "max_weight": f"{Lmax}/max_weight", "sq_norm": f"{Lmax}/sq_norm",
                  "var_out": f"{Lmax}/var_out", "var_out_raw": f"{Lmax}/var_out_raw",
                  "dist_true": f"{Lmax}/dist/true/{plan.distance_n}"}
    if sep_n is not None:
        layer_keys["sep_ratio"] = f"{Lmax}/sep/ratio/{sep_n}"
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        by_layer = {k: np.nanmean(acc.mean(key), axis=1).tolist() for k, key in layer_keys.items() if key in acc.sums}
    by_layer.update(length=Lmax, sep_n=sep_n)
    return by_layer
