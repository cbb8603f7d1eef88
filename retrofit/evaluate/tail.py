"""The AVnorm post's metric: the loss in the last position bucket [L/2, L) of a forward of length L (beside windows').

    tails = window_tails(losses)          # (B, L) losses -> (B, 2): each window's mean over [L/4, L/2), [L/2, L)
    sections = tail_sections(results)     # markdown tables: per model, and over seeds with the control's difference

The post (its train_gpt.py, "stratified_loss") runs one long forward per document and reports the mean loss over the
positions [2^(k-1), 2^k) for every k: at 2x the training length, the predictions that saw between 1x and 2x tokens of
context, and nothing shorter. A window mean at length L averages every position 0..L-1, so most of it is short context
and a jump at 2x is diluted. Each length's rows here keep, per window, the mean over its last two log-spaced buckets
(`tail_buckets`, [L/4, L/2) and [L/2, L) for a power of two): the last is the post's value at L, computed inside one
forward of length L, and for a causal model the same as in one forward at the longest length (a prediction sees only
the tokens before it), on more windows. The rise, last minus previous bucket, is paired within each window: the post's
"jump" at 2x with an interval over windows. Units: windows within a run; seeds over runs (retrofit.evaluate.seeds).
"""

from __future__ import annotations

import numpy as np
import torch

from .intervals import as_list, equivalent, mean_interval, plus_minus
from .report_tables import APPROX_LEGEND, difference_cell, legend, markdown_table
from .seeds import controls, seed_groups
from .windows import position_buckets


def tail_buckets(length: int) -> list[list[int]]:
    """The last two log-spaced position buckets of a window of `length` ([L/4, L/2) and [L/2, L) for a power of two);
    one bucket for a window of 2 tokens or fewer."""
    return [list(b) for b in position_buckets(length)[-2:]]


def window_tails(losses: torch.Tensor) -> torch.Tensor:
    """(B, L) per-token losses -> (B, k) float64: each window's mean loss over each of tail_buckets(L)."""
    return torch.stack([losses[:, a:b].double().mean(1) for a, b in tail_buckets(losses.shape[1])], 1)


def _tails(row: dict) -> np.ndarray | None:
    """(windows, 2) of a length row that kept them (rows older retrofits wrote did not), else None."""
    tails = row.get("window_tails")
    if not tails or len(tails[0]) < 2:
        return None
    return np.asarray(tails, dtype=np.float64)


def tail_cells(row: dict) -> dict | None:
    """One length row's post metric: the last bucket's mean with its interval over windows, and the rise from the
    previous bucket (paired within windows)."""
    tails = _tails(row)
    if tails is None:
        return None
    rise = tails[:, 1] - tails[:, 0]
    return {"bucket": row["tail_buckets"][-1], "loss": float(tails[:, 1].mean()),
            "ci95": as_list(mean_interval(tails[:, 1])), "rise": float(rise.mean()),
            "rise_ci95": as_list(mean_interval(rise)), "windows": int(tails.shape[0])}


def model_tail_tables(results: dict) -> list[tuple[str, str]]:
    """Per model: the last bucket's loss and its rise from the previous bucket, by length (n = windows)."""
    per_model = {m["name"]: {r["length"]: r for r in m.get("lengths") or [] if _tails(r) is not None}
                 for m in results["models"]}
    lengths = sorted({n for rows in per_model.values() for n in rows})
    if not lengths:
        return []
    loss_rows, rise_rows = [], []
    for name, rows in per_model.items():
        cells = {n: tail_cells(r) for n, r in rows.items()}
        loss_rows.append([name] + [plus_minus(c["loss"], c["ci95"], c["windows"]) if (c := cells.get(n)) else None
                                   for n in lengths])
        rise_rows.append([name] + [difference_cell(c["rise"], c["rise_ci95"], c["windows"]) if (c := cells.get(n))
                                   else None for n in lengths])
    header = [f"{n} [{a}, {b})" for n in lengths for a, b in tail_buckets(n)[-1:]]
    return [("Loss in the last position bucket (the AVnorm post's metric)",
             "Mean next-token loss over positions [L/2, L) of each window of length L (the predictions that saw "
             "between L/2 and L tokens), with the 95% interval over windows (n).\n\n"
             + markdown_table(["model \\ L [bucket]"] + header, loss_rows)),
            ("Rise into the last bucket (the post's jump)",
             "The last bucket's loss minus the previous bucket's ([L/4, L/2)) within the same windows, with the "
             "paired 95% interval over windows: at 2x the trained length, the post's jump.\n\n"
             + markdown_table(["model \\ L [bucket]"] + header, rise_rows) + f"\n\n{APPROX_LEGEND}")]


def _per_seed(by_seed: dict, length: int, value) -> dict[int, float]:
    """seed -> value(tails) for the runs of one arm that kept tails at `length`."""
    out = {}
    for seed, entry in by_seed.items():
        row = next((r for r in entry.get("lengths") or [] if r["length"] == length), None)
        if row is not None and _tails(row) is not None:
            out[seed] = value(row)
    return out


def seed_tail_table(results: dict, control: str | None) -> list[tuple[str, str]]:
    """Over training seeds (one unit each, windows averaged within a seed): each arm's last-bucket loss, its rise, and
    its last-bucket difference to the control paired on the same windows within each seed."""
    groups = seed_groups(results)
    lengths = sorted({r["length"] for g in groups.values() for e in g.values() for r in e.get("lengths") or []
                      if _tails(r) is not None})
    if not groups or not lengths:
        return []

    margin = (results.get("settings") or {}).get("equivalence_margin")

    def cell(values: dict, signed: bool, judged: bool = False):
        if not values:
            return None
        mean, interval = float(np.mean(list(values.values()))), as_list(mean_interval(list(values.values())))
        same = equivalent(list(values.values()), margin) if judged and margin is not None else None
        return difference_cell(mean, interval, len(values), same) if signed \
            else plus_minus(mean, interval, len(values))

    rows, rises, gaps, compared_with = [], [], [], controls(results, control)
    for arm, by_seed in groups.items():
        rows.append([arm] + [cell(_per_seed(by_seed, n, lambda r: _tails(r)[:, 1].mean()), False) for n in lengths])
        rises.append([arm] + [cell(_per_seed(by_seed, n, lambda r: (_tails(r)[:, 1] - _tails(r)[:, 0]).mean()), True)
                              for n in lengths])
        against = compared_with.get(arm)
        if against in groups and arm != against:
            gaps.append([arm] + [cell(_paired_gap(by_seed, groups[against], n), True, True) for n in lengths])
    header = [f"{n} [{a}, {b})" for n in lengths for a, b in tail_buckets(n)[-1:]]
    sections = [("Last-bucket loss over seeds",
                 "Each arm's loss over positions [L/2, L), averaged over windows within a seed, then over seeds with "
                 "the 95% interval over seeds (n = seeds).\n\n" + markdown_table(["arm"] + header, rows)),
                ("Rise into the last bucket over seeds",
                 "Last bucket minus the previous bucket within each window, averaged within a seed, then over seeds "
                 "(n = seeds).\n\n" + markdown_table(["arm"] + header, rises) + f"\n\n{APPROX_LEGEND}")]
    if gaps:
        if len(set(compared_with.values())) > 1:  # evaluation variants: each arm against the control under its own
            control = "the control under the same variant"
        sections.append((f"Last-bucket difference to {control} over seeds",
                         f"Loss over [L/2, L) minus {control}'s on the same windows within each seed, then over seeds "
                         "(n = seeds).\n\n" + markdown_table([f"arm − {control}"] + header, gaps)
                         + f"\n\n{legend(results)}"))
    return sections


def _paired_gap(by_seed: dict, control: dict, length: int) -> dict[int, float]:
    """seed -> mean over windows of (arm's last bucket - control's), where both ran on the same windows."""
    out = {}
    for seed, entry in by_seed.items():
        row = next((r for r in entry.get("lengths") or [] if r["length"] == length), None)
        base = next((r for r in (control.get(seed) or {}).get("lengths") or [] if r["length"] == length), None)
        if row is None or base is None or _tails(row) is None or _tails(base) is None \
                or not row.get("windows_sha1") or row.get("windows_sha1") != base.get("windows_sha1"):
            continue
        out[seed] = float((_tails(row)[:, 1] - _tails(base)[:, 1]).mean())
    return out


def tail_sections(results: dict) -> list[tuple[str, str]]:
    """Every table of the post's metric the results can give: per model, then over seeds (control: the seeds
    summary's)."""
    control = (results.get("seeds") or {}).get("control")
    return model_tail_tables(results) + seed_tail_table(results, control)


__all__ = ["model_tail_tables", "seed_tail_table", "tail_buckets", "tail_cells", "tail_sections", "window_tails"]
