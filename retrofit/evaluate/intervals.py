"""Every interval retrofit reports is made here: `mean_interval` for means (and paired differences, and means over
seeds), `proportion_interval` (Wilson) for proportions.

    lo, hi = mean_interval(window_losses)                   # mean loss of one model at one length
    lo, hi = mean_interval(a - b)                           # paired: same windows, two models
    lo, hi = mean_interval(per_seed_means)                  # over training seeds (windows averaged within a seed)
    lo, hi = proportion_interval(successes=7, trials=10)    # passkey / needle accuracy
    plus_minus(3.397, (3.376, 3.418), n=3)                  # '3.397 ± 0.021 (n=3)': tables always show n
    equivalent(a - b, margin=0.02)                          # "matches": both one-sided tests reject |d| >= margin

The unit is what varies independently: a window (L + 1 tokens of one document), a counting sequence, a needle
sample, a training seed; tokens inside a window are not independent, so they never count as units.

Why Student's t throughout, and no bootstrap: retrofit's means stand on 2-10 windows or seeds, where a percentile
bootstrap cannot reach its level (at n = 3 it is the [min, max] of the three values and covers a normal mean ~73% of
the time; expanded for small n it still needs the t quantile to be right). The t interval is exact for normal
units at every n >= 2 and, by the central limit theorem, approaches the level for any finite-variance units as n
grows, where a bootstrap would give the same width to within its resampling noise. So one formula, with no
resampling seed, serves every n; tests/evaluate/test_intervals.py measures its coverage at n = 2 ... 30 on normal and
heavy-tailed (Student t, 3 df) units. n = 1 has no variation to use: no interval.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import stats

LEVEL = 0.95
METHOD = ("Student's t interval of the mean over units (n - 1 degrees of freedom; paired differences: over the "
          "per-unit differences; seeds: over the per-seed means), none for n = 1; Wilson score for proportions")



@lru_cache(maxsize=None)
def _t_quantile(n: int, level: float) -> float:
    return float(stats.t.ppf(0.5 + level / 2, df=n - 1))


def mean_interval(values, level: float = LEVEL) -> tuple[float, float] | None:
    """(lo, hi) of the mean of `values` (one per independent unit): mean ± t_{n-1} · sd / sqrt(n); None for fewer
    than 2 units. All-equal values give (v, v): a model compared with itself on the same windows is (0, 0)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n < 2:
        return None
    mean = float(x.mean())
    half = _t_quantile(n, level) * float(x.std(ddof=1)) / math.sqrt(n)
    return (mean - half, mean + half)


def proportion_interval(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float] | None:
    """(lo, hi) Wilson score interval of a proportion (Wilson 1927); None for no trials. A proportion is not a mean
    of normal-ish units (0/10 has sd 0), so it gets the interval made for it."""
    if trials <= 0:
        return None
    z = float(stats.norm.ppf(0.5 + level / 2))
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # at p = 0 or 1 the bound is exactly 0 or 1 (rounding would give 1e-17 or 0.9999999999999999)
    return (0.0 if successes == 0 else lo, 1.0 if successes == trials else hi)


def equivalent(values, margin: float | None, level: float = LEVEL) -> bool | None:
    """Whether the mean of `values` (paired differences, or per-seed differences) is shown to lie within ±margin: two
    one-sided t tests at 1 - level each (Schuirmann 1987), i.e. the (2·level − 1) t interval (90% for 95%) lies
    inside (−margin, +margin). None without a margin or with fewer than 2 units. A difference may be both shown
    (its 95% interval excludes 0) and equivalent (smaller than the margin): 'matches' claims only the second."""
    if margin is None:
        return None
    interval = mean_interval(values, 2 * level - 1)
    return None if interval is None else bool(-margin < interval[0] and interval[1] < margin)


def as_list(interval) -> list[float] | None:
    """An interval as results.json stores it ([lo, hi] or null)."""
    return None if interval is None else [float(interval[0]), float(interval[1])]


def covers_zero(interval) -> bool | None:
    """Whether a difference's interval contains 0 (None: no interval). A difference is called only when False."""
    return None if interval is None else interval[0] <= 0.0 <= interval[1]


def plus_minus(value: float, interval, n: int | None = None, digits: int = 3) -> str:
    """'3.397 ± 0.021 (n=3)' (half the interval's width, and the number of units); the bare value with its n when
    there is no interval ('3.412 (n=1)'), and without n when n is not known."""
    count = "" if n is None else f" (n={n})"
    if interval is None:
        return f"{value:.{digits}f}{count}"
    return f"{value:.{digits}f} ± {(interval[1] - interval[0]) / 2:.{digits}f}{count}"


def bounds(value: float, interval, n: int | None = None, digits: int = 3) -> str:
    """'0.750 [0.409, 0.929] (n=10)': both ends, for intervals that are not symmetric (Wilson)."""
    count = "" if n is None else f" (n={n})"
    if interval is None:
        return f"{value:.{digits}f}{count}"
    return f"{value:.{digits}f} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]{count}"
