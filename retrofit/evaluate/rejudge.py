"""Judge finished results again without re-scoring: every interval and paired difference recomputed from the
per-unit values results.json keeps (window losses, counting sequences' L1, passkey counts, RULER scores).

    results = rejudge(json.load(open("docs/results/x/results.json")))
    retrofit report docs/results/x          # the same, the folder's reports rewritten (experiment.rewrite_reports)

A row whose units were not kept (results older retrofits wrote) gets no interval: its value is shown with its n only.
"""

from __future__ import annotations

import copy

from .compare import comparison_references, judged
from .intervals import METHOD, as_list, mean_interval, proportion_interval

_UNITS = {"lengths": "window_losses", "counting": "sequence_l1", "passkey": "correct", "ruler": "scores"}


def _interval(row: dict, key: str):
    """The interval of one row from its stored units (None when they were not kept, or n = 1)."""
    if _UNITS[key] not in row:
        return None
    if key == "lengths":
        return mean_interval(row["window_losses"])
    if key == "counting":
        return mean_interval(row["sequence_l1"])
    if key == "passkey":
        return proportion_interval(row["correct"], row["trials"])
    scores = row["scores"] or []  # ruler: Wilson when every score is 0 or 1 (as ruler.score_row)
    binary = all(s in (0.0, 1.0) for s in scores)
    return proportion_interval(int(sum(scores)), len(scores)) if binary else mean_interval(scores)


def rejudge(results: dict, reference=None, margin: float | None = None) -> dict:
    """A copy of an evaluation's results with every ci95 recomputed (retrofit.evaluate.intervals), the paired
    differences to `reference` (default: the references it was compared with) and the summary over seeds afresh,
    and settings.intervals naming the method (left out when no row kept its units: nothing was judged). margin: an
    equivalence margin to declare (nats; kept in settings.equivalence_margin, so a later rejudge keeps it)."""
    results = copy.deepcopy(results)
    judged_any = False
    for model in results["models"]:
        for key in ("lengths", "counting", "passkey", "ruler"):
            for row in model.get(key) or []:
                interval = _interval(row, key)
                judged_any |= _UNITS[key] in row  # kept its units: judged, even where n = 1 gives no interval
                if "ci95" in row or interval is not None:
                    row["ci95"] = as_list(interval)
    settings = results.setdefault("settings", {})
    if judged_any:
        settings["intervals"] = METHOD
    else:
        settings.pop("intervals", None)
    references = reference if reference is not None else (comparison_references(results) or None)
    return judged(results, references, margin)
