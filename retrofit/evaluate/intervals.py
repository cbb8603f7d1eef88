"""95% intervals for every number an evaluation reports: bootstrap over units (windows, sequences, samples) for
means and paired differences, Wilson for accuracies.

    lo, hi = bootstrap_mean(window_losses)                  # mean loss of one model at one length
    lo, hi = bootstrap_mean(a - b)                          # paired: same windows, two models
    lo, hi = wilson(successes=7, trials=10)                 # passkey / needle accuracy

The unit is what varies independently: a window (L + 1 tokens of one document), a counting sequence, a needle
sample; tokens inside a window are not independent, so they are never resampled. The bootstrap is the percentile
interval *expanded* for small samples (Hesterberg 2015, "What teachers should know about the bootstrap", §4.3):
the percentile interval of n values covers about (n-1)/n of what it should, so its tail probability is taken at
Phi(-sqrt(n / (n-1)) * t_{n-1}) instead of 2.5%, which gives the t interval's width for normal data and keeps
the bootstrap's skew. Resampling is seeded, so the same values give the same interval.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 2000
METHOD = f"expanded percentile bootstrap over units, {RESAMPLES} resamples, seed 0; Wilson for accuracies"


def bootstrap_mean(values, *, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> list[float] | None:
    """[lo, hi] of the mean of `values` (one per independent unit); None below 2 units (no variation to use).
    All equal values give [v, v]: a model compared with itself on the same windows has the interval [0, 0]."""
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n < 2:
        return None
    if np.all(x == x[0]):
        return [float(x[0]), float(x[0])]
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    tail = _expanded_tail(n, level)
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return [float(lo), float(hi)]


def _expanded_tail(n: int, level: float) -> float:
    """The tail probability whose normal quantile is sqrt(n / (n - 1)) times Student's t quantile (Hesterberg)."""
    t = stats.t.ppf(0.5 + level / 2, df=n - 1)
    return float(stats.norm.cdf(-math.sqrt(n / (n - 1)) * t))


def wilson(successes: int, trials: int, level: float = LEVEL) -> list[float] | None:
    """[lo, hi] Wilson score interval of a proportion (Wilson 1927); None for no trials."""
    if trials <= 0:
        return None
    z = float(stats.norm.ppf(0.5 + level / 2))
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # at p = 0 or 1 the bound is exactly 0 or 1 (rounding would give 1e-17 or 0.9999999999999999)
    return [0.0 if successes == 0 else lo, 1.0 if successes == trials else hi]


def covers_zero(interval) -> bool | None:
    """Whether a difference's interval contains 0 (None: no interval)."""
    return None if interval is None else interval[0] <= 0.0 <= interval[1]


def plus_minus(value: float, interval, digits: int = 3) -> str:
    """'3.397 ± 0.021' (half the interval's width); the bare value when there is no interval."""
    if interval is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ± {(interval[1] - interval[0]) / 2:.{digits}f}"
