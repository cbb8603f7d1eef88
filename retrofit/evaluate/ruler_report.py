"""results.md tables of the RULER-style rows (models[].ruler): one table per task, a row per model (x depth for
the niah tasks), a column per length, each cell `score [lo, hi] (n=6)`: the mean and its 95% interval over the samples
(Wilson intervals of few samples are lopsided near 0 and 1, so both ends are printed, not a ±)."""

from __future__ import annotations

from ..io.escape import md_inline
from .intervals import bounds
from .report_tables import markdown_table

# the JSON Schema of one row, merged into report.RESULTS_SCHEMA's model properties (docs/results-schema.md)
RULER_ROW = {"type": "object", "required": ["task", "length", "score", "samples", "scores"],
             "properties": {"task": {"type": "string"}, "length": {"type": "integer"},
                            "depth": {"type": ["number", "null"]},
                            "score": {"type": "number", "minimum": 0, "maximum": 1},
                            "samples": {"type": "integer", "minimum": 1},
                            "ci95": {"type": ["array", "null"], "items": {"type": "number"}},
                            "metric": {"type": "string"}, "scores": {"type": "array", "items": {"type": "number"}},
                            "predictions": {"type": "array", "items": {"type": "string"}},
                            "tokens": {"type": "array", "items": {"type": "integer"}}}}


def ruler_tables(results: dict) -> list[tuple[str, str]]:
    """[(title, markdown table)] for each RULER task any model ran, in the order first seen."""
    rows = [(m["name"], r) for m in results["models"] for r in m.get("ruler") or []]
    tasks = list(dict.fromkeys(r["task"] for _, r in rows))
    tables = []
    for task in tasks:
        mine = [(name, r) for name, r in rows if r["task"] == task]
        lengths = sorted({r["length"] for _, r in mine})
        keys = list(dict.fromkeys((name, r.get("depth")) for name, r in mine))
        depth = any(d is not None for _, d in keys)
        header = ["model"] + (["depth"] if depth else []) + [str(n) for n in lengths]
        body = []
        for name, d in keys:
            cells = {r["length"]: _cell(r["score"], r.get("ci95"), r.get("samples")) for n, r in mine
                     if n == name and r.get("depth") == d}
            body.append([name] + ([f"{d:g}"] if depth else []) + [cells.get(n, "") for n in lengths])
        tables.append((f"RULER {md_inline(task)} (string_match_all: mean [95% interval] over samples)",
                       markdown_table(header, body)))
    return tables


def _cell(score: float, interval, samples) -> str:
    return bounds(score, interval, samples, digits=2)
