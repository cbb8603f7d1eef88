"""Markdown tables from a results dict (docs/results-schema.md): loss by length with 95% intervals, paired
differences to the reference model, time and memory, loss by position, passkey (Wilson) and counting; and the
tidy rows of results.csv. retrofit.evaluate.report re-exports them.
"""

from __future__ import annotations

from ..io.escape import md_inline
from .intervals import bounds, covers_zero, plus_minus

APPROX = "≈"
APPROX_LEGEND = (f"{APPROX}: the interval covers 0 — no difference shown (a difference is called only when its "
                 "95% interval excludes 0); n: the units it stands on (windows; seeds in a seed table).")
EQUIVALENT = "≡"


def _margin(results: dict) -> float | None:
    return (results.get("settings") or {}).get("equivalence_margin")


def legend(results: dict) -> str:
    """APPROX_LEGEND, and the equivalence mark's meaning when the results declare a margin."""
    margin = _margin(results)
    if margin is None:
        return APPROX_LEGEND
    return (APPROX_LEGEND + f" {EQUIVALENT}: equivalent within ±{margin:g} (the margin given to `retrofit report "
            f"--margin`: two one-sided t tests at 5%, i.e. the 90% interval lies inside ±{margin:g}; it may still "
            "exclude 0); only these are 'matches'.")

# ---- tables -------------------------------------------------------------------------------------------------

def tidy_rows(results: dict) -> list[dict]:
    """One row per (model, task, metric, length, depth or position bucket): what results.csv holds."""
    rows = []
    for m in results["models"]:
        base = {"model": m["name"], "depth": "", "position_start": "", "position_end": ""}
        for r in m.get("lengths", []):
            for metric in ("loss", "time_s", "tokens_per_s", "peak_memory_mb"):
                if metric in r:
                    rows.append({**base, "task": "lm", "metric": metric, "length": r["length"], "value": r[metric],
                                 "count": r["tokens"], **_bounds(r.get("ci95") if metric == "loss" else None)})
            for b in r["by_position"]:
                rows.append({**base, "task": "lm", "metric": "loss_by_position", "length": r["length"],
                             "position_start": b["start"], "position_end": b["end"], "value": b["loss"],
                             "count": b["tokens"]})
        for r in m.get("passkey", []):
            rows.append({**base, "task": "passkey", "metric": "accuracy", "length": r["length"], "depth": r["depth"],
                         "value": r["accuracy"], "count": r["trials"], **_bounds(r.get("ci95"))})
        for r in m.get("counting", []):
            for metric in ("l1", "mse"):
                rows.append({**base, "task": "counting", "metric": metric, "length": r["length"], "value": r[metric],
                             "count": r["sequences"], **_bounds(r.get("ci95") if metric == "l1" else None)})
            for b in r.get("by_position", []):
                rows.append({**base, "task": "counting", "metric": "l1_by_position", "length": r["length"],
                             "position_start": b["start"], "position_end": b["end"], "value": b["l1"],
                             "count": b["tokens"]})
        for r in m.get("ruler", []):  # count: samples (the interval's unit)
            rows.append({**base, "task": r["task"], "metric": r.get("metric", "score"), "length": r["length"],
                         "depth": "" if r.get("depth") is None else r["depth"], "value": r["score"],
                         "count": r["samples"], **_bounds(r.get("ci95"))})
    for c in (results.get("comparisons") or {}).get("rows", []):
        rows.append({"model": c["model"], "depth": "", "position_start": "", "position_end": "", "task": "lm",
                     "metric": f"loss_minus_{c.get('reference', results['comparisons']['reference'])}",
                     "length": c["length"],
                     "value": c["difference"], "count": c["windows"], **_bounds(c.get("ci95"))})
    return rows


def _bounds(interval) -> dict:
    """The ci95 columns of a results.csv row (blank without an interval)."""
    return {"ci95_lo": interval[0], "ci95_hi": interval[1]} if interval else {"ci95_lo": "", "ci95_hi": ""}


CSV_COLUMNS = ["model", "task", "metric", "length", "depth", "position_start", "position_end", "value", "count",
               "ci95_lo", "ci95_hi"]


def markdown_table(header: list, rows: list[list]) -> str:
    """A GitHub markdown table; floats get 3 decimals (below 100) or none, None is blank, text is escaped
    (retrofit.io.escape.md_inline)."""
    def cell(x):  # a name from a results file is text: `|`, a newline or a tag would remake the table
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"
        return "" if x is None else md_inline(x)
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def model_label(m: dict) -> str:
    """A model's name with its RoPE extension, e.g. 'softmax-yarn [yarn x4 (orig 8192)]'; the name alone without."""
    return f"{m['name']} [{m['rope']}]" if m.get("rope") not in (None, "none") else m["name"]


def model_limit(m: dict) -> int | None:
    """The positions a model was trained for: original_positions (before a RoPE extension), else
    max_position_embeddings (results written before original_positions existed)."""
    return m.get("original_positions", m.get("max_position_embeddings"))


def loss_table_markdown(results: dict, metric: str = "loss") -> str:
    """Rows models (named with their RoPE extension), columns lengths; the training length's column is
    marked, and values at lengths beyond a model's original positions carry a dagger. Losses print as
    `3.397 ± 0.021 (n=3)` (half the 95% interval's width, n windows) where the row has one."""
    train = results.get("train_len")
    header = ["model"] + [f"**{n}** (train)" if n == train else str(n) for n in results["lengths"]]
    rows = []
    for m in results["models"]:
        by_length = {r["length"]: r for r in m.get("lengths", [])}
        rows.append([model_label(m)] + [
            None if n not in by_length
            else plus_minus(by_length[n][metric], by_length[n].get("ci95") if metric == "loss" else None,
                            by_length[n].get("windows") if metric == "loss" else None)
            + (" †" * by_length[n]["beyond_max_positions"])
            for n in results["lengths"]])
    table = markdown_table(header, rows)
    if any(r["beyond_max_positions"] for m in results["models"] for r in m.get("lengths", [])):
        extended = any(m.get("rope") not in (None, "none") for m in results["models"])
        table += ("\n\n† beyond the model's original positions (" + ", ".join(
            f"{md_inline(m['name'])} {model_limit(m)}" for m in results["models"] if model_limit(m))
                  + "): RoPE evaluated "
                  "anyway" + (", extended where [TYPE xFACTOR] names it." if extended else "."))
    return table


def cost_table_markdown(results: dict) -> str:
    """One row per model and length: windows, tokens, loss, seconds, tokens/s, peak memory."""
    rows = [[m["name"], r["length"], r["windows"], r["tokens"], r["loss"], f"{r['time_s']:.1f}",
             round(r.get("tokens_per_s", 0)), round(r["peak_memory_mb"])]
            for m in results["models"] for r in m.get("lengths", [])]
    kind = {m.get("memory_kind", "rss") for m in results["models"]}
    return markdown_table(["model", "length", "windows", "tokens", "loss", "time (s)", "tokens/s",
                           f"peak memory (MiB, {'/'.join(sorted(kind))})"], rows)


def position_table_markdown(results: dict, length: int | None = None) -> str:
    """Rows models, columns position buckets, at `length` (default: the longest)."""
    length = length or max(results["lengths"], default=0)
    rows, header = [], None
    for m in results["models"]:
        r = next((r for r in m.get("lengths", []) if r["length"] == length), None)
        if r is None:
            continue
        header = header or ["model"] + [str(b["start"]) if b["end"] - b["start"] == 1
                                        else f"{b['start']}–{b['end'] - 1}"
                                        for b in r["by_position"]]
        rows.append([m["name"]] + [b["loss"] for b in r["by_position"]])
    return markdown_table(header, rows) if rows else ""


def task_table_markdown(results: dict, task: str, metric: str, column: str) -> str:
    """Rows models (x depth, for passkey), columns lengths: a passkey or counting metric, with its 95% interval
    and n where the row has one (passkey: Wilson `0.750 [0.409, 0.929] (n=10)`; counting L1: `± half-width (n=8)`)."""
    rows, lengths = [], sorted({r["length"] for m in results["models"] for r in m.get(task, [])})
    for m in results["models"]:
        keys = sorted({(r.get(column) if column else None) for r in m.get(task, [])}, key=lambda k: k or 0)
        for key in keys:
            cells = {r["length"]: _task_cell(r, metric) for r in m.get(task, []) if not column or r[column] == key}
            rows.append([m["name"] if key is None else f"{m['name']} @ {column} {key:g}"]
                        + [cells.get(n) for n in lengths])
    return markdown_table(["model"] + lengths, rows) if rows else ""


def _task_cell(row: dict, metric: str):
    if metric not in ("accuracy", "l1"):
        return row[metric]
    if metric == "accuracy":  # Wilson is not symmetric: both ends
        return bounds(row[metric], row.get("ci95"), row.get("trials"))
    return plus_minus(row[metric], row.get("ci95"), row.get("sequences"))


def comparison_table_markdown(results: dict, reference: str | None = None) -> str:
    """Rows models, columns lengths: each model's mean loss minus `reference`'s (default: the first reference) on
    the same windows, `+0.012 ± 0.004 (n=3)`, with a trailing ≈ where the paired interval covers 0; `(unpaired)` where
    the windows differ (no interval). Empty without comparisons."""
    comparisons = results.get("comparisons") or {}
    reference = reference or comparisons.get("reference")
    found = [c for c in comparisons.get("rows") or [] if c.get("reference", comparisons.get("reference")) == reference]
    if not found:
        return ""
    lengths = sorted({c["length"] for c in found})
    models = list(dict.fromkeys(c["model"] for c in found))
    cells = {(c["model"], c["length"]): _difference_cell(c) for c in found}
    rows = [[name] + [cells.get((name, n)) for n in lengths] for name in models]
    return (markdown_table([f"model − {reference}"] + lengths, rows) + "\n\n"
            + verdict_lines(found, "model", "windows", _margin(results)))


def _difference_cell(c: dict) -> str:
    if c.get("paired") is False:
        return f"{c['difference']:+.3f} (unpaired, n={c.get('windows')})"
    return difference_cell(c["difference"], c.get("ci95"), c.get("windows"), c.get("equivalent"))


def difference_cell(difference: float, interval, n: int | None, equivalent: bool | None = None) -> str:
    """'+0.012 ± 0.004 (n=3)', with ' ≡' when it is shown to lie within the declared margin (`equivalent`), else ' ≈'
    when the interval covers 0 (no difference shown); '+0.012 (n=1)' without an interval (nothing shown)."""
    text = ("+" if difference >= 0 else "") + plus_minus(difference, interval, n)
    return text + (f" {EQUIVALENT}" if equivalent else f" {APPROX}" if covers_zero(interval) else "")


def verdict_lines(rows: list[dict], key: str, unit: str, margin: float | None = None) -> str:
    """What each row's model (or arm) shows across the lengths, generated so that no report says 'at every length'
    unless every length's interval excludes 0: '- avnorm: higher at 256, 512; no difference shown at 1024'. A length
    within the declared margin keeps its direction and size: 'within ±0.02 at 16384 (lower by 0.004 ± 0.004)'."""
    lines = []
    within = f"within ±{margin:g}" if margin is not None else "within the margin"
    for name in dict.fromkeys(r[key] for r in rows):
        found = {"higher": [], "lower": [], within: [], "no difference shown": [], "no interval": []}
        for r in sorted((r for r in rows if r[key] == name), key=lambda r: r["length"]):
            verdict = within if r.get("equivalent") else "no interval" if r.get("ci95") is None \
                else "no difference shown" if covers_zero(r["ci95"]) else "higher" if r["difference"] > 0 else "lower"
            found[verdict].append(f"{r['length']} ({_direction(r)})" if verdict == within else str(r["length"]))
        total = sum(map(len, found.values()))
        parts = [f"{what} at {_every(at) if len(at) == total > 1 else ', '.join(at)}" for what, at in found.items()
                 if at]
        lines.append(f"- {name}: " + "; ".join(parts))
    margin_note = f"; {within}: equivalent, {EQUIVALENT}, with its direction and size" \
        if any("equivalent" in r for r in rows) else ""
    return (f"By length (higher / lower: the 95% interval over {unit} excludes 0{margin_note}):\n\n"
            + "\n".join(lines)) if lines else ""


def _direction(row: dict) -> str:
    """'lower by 0.004 ± 0.004' (the 95% half-width), ' ≈' added when that interval covers 0."""
    size = plus_minus(abs(row["difference"]), row["ci95"])
    way = "higher" if row["difference"] > 0 else "lower" if row["difference"] < 0 else "equal,"
    return f"{way} by {size}" + (f" {APPROX}" if covers_zero(row["ci95"]) else "")


def _every(items: list[str]) -> str:
    """'every length' for plain lengths; with sizes, each length still names its own: 'every length: 16 (...), ...'."""
    return "every length" if all(i.isdigit() for i in items) else "every length: " + ", ".join(items)


def windows_table_markdown(results: dict) -> str:
    """Rows lengths: windows scored and how many each document gave (from the first model with intervals'
    rows; models sharing a tokenizer share their windows). Empty for results written before intervals."""
    m = next((m for m in results["models"] if any("windows_by_document" in r for r in m.get("lengths", []))), None)
    if m is None:
        return ""
    rows = [[r["length"], r["windows"], " / ".join(map(str, r["windows_by_document"]))]
            for r in m["lengths"] if "windows_by_document" in r]
    return markdown_table(["length", "windows", "windows per document (in --data order)"], rows)


def seed_sections(results: dict) -> list[tuple[str, str]]:
    """An experiment with seeds (results['seeds'], retrofit.evaluate.seeds): each arm's mean loss over seeds and
    its difference to the control, each with the interval over seeds (n = seeds; windows averaged within a seed)."""
    summary = results.get("seeds")
    if not summary:
        return []
    lengths = sorted({r["length"] for r in summary["arms"]})
    arms = list(dict.fromkeys(r["arm"] for r in summary["arms"]))
    means = {(r["arm"], r["length"]): plus_minus(r["value"], r["ci95"], r["seeds"]) for r in summary["arms"]}
    units, metric = sorted({r["units"] for r in summary["arms"]}), summary.get("metric", "loss")
    sections = [(f"Mean over seeds {summary['seeds']}",
                 f"Each arm's {metric} averaged over its units ({'/'.join(map(str, units))} windows or sequences a "
                 "length) within a seed, then over seeds, with the 95% interval over seeds (n = seeds).\n\n"
                 + markdown_table(["arm"] + lengths, [[a] + [means.get((a, n)) for n in lengths] for a in arms]))]
    if summary["differences"]:
        control, shown = summary["control"], md_inline(summary["control"])  # a table's cells are escaped by it
        if summary.get("controls"):  # evaluation variants: each arm against the control under its own variant
            control = shown = "the control under the same variant"
        cells = {(r["arm"], r["length"]): difference_cell(r["difference"], r["ci95"], r["seeds"], r.get("equivalent"))
                 for r in summary["differences"]}
        others = list(dict.fromkeys(r["arm"] for r in summary["differences"]))
        sections.append((f"Difference to {shown} over seeds",
                         f"Mean {metric} minus {shown}'s, paired on the same units within each seed, then averaged "
                         "over seeds with the 95% interval over seeds (n = seeds): the difference another training "
                         "seed would be expected to reproduce.\n\n"
                         + markdown_table([f"arm − {control}"] + lengths,
                                          [[a] + [cells.get((a, n)) for n in lengths] for a in others])
                         + "\n\n" + verdict_lines(summary["differences"], "arm", "seeds", _margin(results))
                         + f"\n\n{legend(results)}"))
    return sections
