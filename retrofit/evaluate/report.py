"""Tables and plots from result dicts: results.json, results.csv, results.md and PNG plots.

    from retrofit.evaluate.report import write_report
    paths = write_report(results, "eval/")     # results: what retrofit.evaluate.evaluate_models returns

The functions below take the results dict (schema: RESULTS_SCHEMA, documented in
docs/results-schema.md) or plain series, so other commands (experiment reports) reuse them. Plots
use matplotlib's Figure directly (the Agg canvas): no pyplot state, no display needed.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text, atomic_writer
from ..io.escape import md_code, md_inline, md_text
from .compare import comparison_references
from .report_tables import (  # noqa: F401  (re-exported: experiment reports and the CLI import them from here)
    APPROX_LEGEND,
    CSV_COLUMNS,
    comparison_table_markdown,
    cost_table_markdown,
    legend,
    loss_table_markdown,
    markdown_table,
    model_label,
    model_limit,
    position_table_markdown,
    seed_sections,
    task_table_markdown,
    tidy_rows,
    windows_table_markdown,
)
from .ruler_report import RULER_ROW, ruler_tables
from .tail import tail_sections

# ---- the schema (a JSON Schema subset; `validate` below checks it without extra dependencies) -----------------

_INT, _NUM, _STR = {"type": "integer"}, {"type": "number"}, {"type": "string"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_CI95 = {"type": ["array", "null"], "items": _NUM}  # [lo, hi] of a 95% interval; null: too few units
_NUMS, _INTS = {"type": "array", "items": _NUM}, {"type": "array", "items": _INT}
_BUCKET = {"type": "object", "required": ["start", "end", "loss", "tokens"],
           "properties": {"start": {"type": "integer", "minimum": 0}, "end": _INT, "loss": _NUM, "tokens": _INT}}
_LENGTH_ROW = {
    "type": "object",
    "required": ["length", "loss", "windows", "tokens", "time_s", "peak_memory_mb", "beyond_max_positions",
                 "by_position"],
    "properties": {"length": {"type": "integer", "minimum": 2}, "loss": _NUM,
                   "windows": {"type": "integer", "minimum": 1},
                   "tokens": _INT, "time_s": _NUM, "tokens_per_s": _NUM, "peak_memory_mb": _NUM,
                   "start_memory_mb": _NUM, "beyond_max_positions": {"type": "boolean"}, "windows_sha1": _STR,
                   "by_position": {"type": "array", "items": _BUCKET},
                   "window_losses": _NUMS, "window_documents": _INTS, "windows_by_document": _INTS, "ci95": _CI95,
                   # each window's mean loss over its last two position buckets (retrofit.evaluate.tail)
                   "tail_buckets": {"type": "array", "items": _INTS},
                   "window_tails": {"type": "array", "items": _NUMS}}}
_PASSKEY_ROW = {"type": "object", "required": ["length", "depth", "accuracy", "trials"],
                "properties": {"length": _INT, "depth": {"type": "number", "minimum": 0, "maximum": 1},
                               "accuracy": {"type": "number", "minimum": 0, "maximum": 1}, "trials": _INT,
                               "correct": _INT, "ci95": _CI95}}
_COUNTING_BUCKET = {"type": "object", "required": ["start", "end", "l1", "tokens"],
                    "properties": {"start": _INT, "end": _INT, "l1": _NUM, "tokens": _INT}}
_COUNTING_ROW = {"type": "object", "required": ["length", "l1", "mse", "sequences"],
                 "properties": {"length": _INT, "l1": _NUM, "mse": _NUM, "sequences": _INT, "mean_count": _NUM,
                                "relative_l1": _NUM, "sequence_l1": _NUMS, "ci95": _CI95,
                                "prefix_of": _INT,  # scored as a prefix of sequences this long (prefixes=True)
                                "by_position": {"type": "array", "items": _COUNTING_BUCKET}}}
_MODEL = {
    "type": "object", "required": ["name", "model_type", "lengths"],
    "properties": {"name": _STR, "source": {"type": ["string", "null"]}, "model_type": _STR, "tokenizer": _STR,
                   "dtype": _STR, "retrofit": {"type": ["object", "null"]}, "max_learned_positions": _INT_OR_NULL,
                   "max_position_embeddings": _INT_OR_NULL, "original_positions": _INT_OR_NULL, "rope": _STR,
                   "eval_patch": {"type": ["object", "null"]}, "memory_kind": {"enum": ["rss", "cuda_allocated"]},
                   "engine": {"enum": ["vllm"]},  # absent: transformers; vllm: retrofit eval --engine vllm
                   "arm": _STR, "seed": _INT,  # an experiment with seeds: the arm this run is of, its training seed
                   "lengths": {"type": "array", "items": _LENGTH_ROW},
                   "passkey": {"type": "array", "items": _PASSKEY_ROW},
                   "counting": {"type": "array", "items": _COUNTING_ROW},
                   "ruler": {"type": "array", "items": RULER_ROW}}}
_COMPARISON_ROW = {"type": "object", "required": ["model", "length", "difference", "ci95", "windows", "paired"],
                   "properties": {"reference": _STR, "model": _STR, "length": _INT, "difference": _NUM, "ci95": _CI95,
                                  "windows": _INT,
                                  "covers_zero": {"type": ["boolean", "null"]}, "paired": {"type": "boolean"},
                                  "equivalent": {"type": ["boolean", "null"]},  # only under a declared margin
                                  "reason": _STR}}
_COMPARISONS = {"type": "object", "required": ["reference", "rows"],
                "properties": {"reference": _STR, "references": {"type": "array", "items": _STR},
                               "rows": {"type": "array", "items": _COMPARISON_ROW}}}
SCHEMA_VERSIONS = ["retrofit.eval/1", "retrofit.eval/2"]  # /2 adds the optional interval fields and comparisons
RESULTS_SCHEMA = {
    "type": "object", "required": ["schema", "train_len", "lengths", "models"],
    "properties": {"schema": {"enum": SCHEMA_VERSIONS}, "train_len": _INT_OR_NULL,
                   "lengths": {"type": "array", "items": {"type": "integer", "minimum": 2}},
                   "data": {"type": "object"}, "settings": {"type": "object"},
                   "models": {"type": "array", "items": _MODEL}, "comparisons": _COMPARISONS,
                   "seeds": {"type": "object", "required": ["seeds", "arms", "differences"]}}}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None), "integer": int,
          "number": (int, float)}


def _is(value, type_name: str) -> bool:
    if isinstance(value, bool) and type_name in ("integer", "number"):
        return False  # bool is an int in Python, but not in JSON
    return isinstance(value, _TYPES[type_name])


def validate(value, schema=RESULTS_SCHEMA, path="results") -> None:
    """Raise RetrofitError naming the first place where `value` breaks `schema` (type, required,
    properties, items, enum, minimum, maximum)."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types and not any(_is(value, t) for t in types):
        raise RetrofitError(f"{path}: expected {' or '.join(types)}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise RetrofitError(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
        raise RetrofitError(f"{path}: {value!r} is outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise RetrofitError(f"{path}: missing key {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")


# ---- plots --------------------------------------------------------------------------------------------------

def _figure(n_axes=1, width=6.0, height=4.0):
    from matplotlib.figure import Figure  # the Agg canvas, without touching pyplot's global backend

    cols = min(3, n_axes)
    rows = math.ceil(n_axes / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_axes:]:
        ax.set_visible(False)
    return fig, axes[:n_axes]


MAX_PIXELS = 4_000_000  # a plot of one panel per model (40 in the fair test) stays a file a page can show


def save_png(fig, path, dpi: int = 120) -> Path:
    """The figure as a PNG at `path`, written atomically (never through a link below a folder retrofit owns). A figure
    of many panels is drawn at a lower dpi so that it has at most MAX_PIXELS pixels."""
    width, height = fig.get_size_inches()
    dpi = min(dpi, int(math.sqrt(MAX_PIXELS / (width * height))))
    with atomic_writer(path, binary=True) as f:
        fig.savefig(f, format="png", dpi=dpi)
    return Path(path)


def _tokens_label(x: float) -> str:
    """1024 -> '1K', 65536 -> '64K', 16 -> '16'."""
    return f"{x / 1024:g}K" if x >= 1024 else f"{x:g}"


def draw_lines(ax, series: dict, *, xlabel, ylabel, title=None, log2x=True, marks=(), colors=None, bands=None):
    """series: label -> (xs, ys). marks: (x, label) vertical lines, e.g. the training length.
    colors: label -> matplotlib color, to keep one model's color across figures.
    bands: label -> (xs, los, his), a shaded 95% interval drawn in its line's color."""
    for label, (xs, ys) in series.items():
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=str(label), color=(colors or {}).get(label))
        if (bands or {}).get(label) and bands[label][0]:
            ax.fill_between(*bands[label], color=line.get_color(), alpha=0.2, linewidth=0)
    if log2x:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda x, _: _tokens_label(x))
    for (x, label), style in zip(marks, ("--", ":", "-.")):
        ax.axvline(x, color="gray", linestyle=style, linewidth=1, label=f"{label} ({x})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def line_plot(series: dict, path, **kwargs) -> Path:
    """One axis of lines (see draw_lines), saved as a PNG."""
    fig, (ax,) = _figure()
    draw_lines(ax, series, **kwargs)
    return save_png(fig, path)


def length_marks(results: dict) -> list[tuple[int, str]]:
    """Vertical lines for length plots: the training length, and the models' original positions (their
    max_position_embeddings before any RoPE extension) when they share one inside the plotted range."""
    marks = [(results["train_len"], "train length")] if results.get("train_len") else []
    limits = {model_limit(m) for m in results["models"]}
    limit = limits.pop() if len(limits) == 1 else None
    if limit and limit != results.get("train_len") and limit < max(results["lengths"], default=0):
        extended = any(m.get("rope") not in (None, "none") for m in results["models"])
        marks.append((limit, "original positions" if extended else "max_position_embeddings"))
    return marks


def plot_loss_vs_length(results: dict, path) -> Path:
    """Mean loss against context length: one line per model, log2 x-axis, the training length marked, and
    the 95% interval as a band over the lengths that have one."""
    models = [m for m in results["models"] if m.get("lengths")]
    series = {model_label(m): ([r["length"] for r in m["lengths"]], [r["loss"] for r in m["lengths"]])
              for m in models}
    bands = {model_label(m): tuple(map(list, zip(*[(r["length"], *r["ci95"]) for r in m["lengths"]
                                                   if r.get("ci95")]))) or ([], [], [])
             for m in models}
    return line_plot(series, path, xlabel="context length (tokens)", ylabel="mean next-token loss",
                     title="Loss by context length", marks=length_marks(results), bands=bands)


def plot_loss_by_position(results: dict, path) -> Path:
    """Loss against position in the window: one panel per model, one line per window length.
    A bucket [a, b) is drawn at x = b, the most tokens of context its predictions saw."""
    models = [m for m in results["models"] if m.get("lengths")]
    fig, axes = _figure(len(models))
    for ax, m in zip(axes, models):
        series = {f"L={r['length']}": ([b["end"] for b in r["by_position"]], [b["loss"] for b in r["by_position"]])
                  for r in m["lengths"]}
        draw_lines(ax, series, xlabel="position in window (tokens of context)", ylabel="loss",
                   title=model_label(m), marks=length_marks(results))
    return save_png(fig, path)


def plot_passkey(results: dict, path) -> Path:
    """Passkey accuracy as a heatmap of depth (rows) x length (columns), one panel per model."""
    models = [m for m in results["models"] if m.get("passkey")]
    fig, axes = _figure(len(models), width=5.0)
    for ax, m in zip(axes, models):
        lengths = sorted({r["length"] for r in m["passkey"]})
        depths = sorted({r["depth"] for r in m["passkey"]})
        grid = [[next((r["accuracy"] for r in m["passkey"] if r["length"] == n and r["depth"] == d), math.nan)
                 for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length")
        ax.set_ylabel("passkey depth")
        ax.set_title(model_label(m))
        fig.colorbar(image, ax=ax, label="accuracy")
    return save_png(fig, path)


def plot_counting(results: dict, path) -> Path:
    """Counting L1 and MSE against length, one line per model."""
    models = [m for m in results["models"] if m.get("counting")]
    fig, axes = _figure(2)
    for ax, metric in zip(axes, ("l1", "mse")):
        series = {model_label(m): ([r["length"] for r in m["counting"]], [r[metric] for r in m["counting"]])
                  for m in models}
        draw_lines(ax, series, xlabel="sequence length", ylabel=metric.upper(), title=f"Counting {metric.upper()}",
                   marks=length_marks(results))
        ax.set_yscale("log")
    return save_png(fig, path)


# ---- everything at once -------------------------------------------------------------------------------------

def write_report(results: dict, out_dir) -> list[Path]:
    """Validate, then write results.json, results.csv, results.md and the plots; returns the paths."""
    validate(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "results.md"]
    atomic_write_text(paths[0], json.dumps(results, indent=1) + "\n")
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(tidy_rows(results))
    atomic_write_text(paths[1], table.getvalue())
    plots = []
    if any(m.get("lengths") for m in results["models"]):
        plots += [plot_loss_vs_length(results, out / "loss_vs_length.png"),
                  plot_loss_by_position(results, out / "loss_by_position.png")]
    if any(m.get("passkey") for m in results["models"]):
        plots.append(plot_passkey(results, out / "passkey.png"))
    if any(m.get("counting") for m in results["models"]):
        plots.append(plot_counting(results, out / "counting.png"))
    atomic_write_text(paths[2], results_markdown(results, [p.name for p in plots]))
    return paths + plots


def results_markdown(results: dict, plots=()) -> str:
    """The human-readable report: what was evaluated, then each table, then the plots."""
    settings, data = results.get("settings", {}), results.get("data", {})
    lines = ["# Length extrapolation", "",
             f"Data: {md_inline(', '.join(data.get('files') or ['given tokens']))} "
             f"({sum(data.get('documents') or [])} tokens). "
             f"Training length: {md_inline(results.get('train_len') or 'not given')}. "
             f"Max tokens per length: {md_inline(settings.get('max_tokens') or 'all')}. "
             + (f"Max windows per length: {md_inline(settings['max_windows'])}. " if settings.get("max_windows")
                else "")
             + f"Window: {md_inline(settings.get('window', 'L tokens'))}.",
             ""]
    for m in results["models"]:
        # every value here is what results.json says (`retrofit report` re-renders it): shown as text
        lines.append(f"- **{md_text(m['name'])}**: {md_inline(m['model_type'])}, {md_inline(m.get('dtype', '?'))}, "
                     f"source {md_code(m.get('source') or 'in memory')}, "
                     f"patch {md_inline(json.dumps(m.get('retrofit')))}, "
                     f"learned positions {md_inline(m.get('max_learned_positions'))}, "
                     f"max_position_embeddings {md_inline(m.get('max_position_embeddings'))}, "
                     f"RoPE extension {md_inline(m.get('rope', 'none'))}, original positions "
                     f"{md_inline(model_limit(m))}"
                     + (f", patched for this evaluation {md_inline(json.dumps(m['eval_patch']))}"
                        if m.get("eval_patch") else ""))
    lines += _interval_lines(results)
    lm = [("Loss by context length", loss_table_markdown(results)),
          *_comparison_section(results),
          *tail_sections(results),  # the AVnorm post's metric: the last position bucket [L/2, L), and its rise
          ("Windows per length and document", windows_table_markdown(results)),
          ("Time and memory per length", cost_table_markdown(results)),
          (f"Loss by position at length {max(results['lengths'], default=0)}", position_table_markdown(results))]
    tasks = [("Passkey accuracy (95% Wilson interval)", task_table_markdown(results, "passkey", "accuracy", "depth")),
             ("Counting L1", task_table_markdown(results, "counting", "l1", None)),
             ("Counting MSE", task_table_markdown(results, "counting", "mse", None))]
    tasks += ruler_tables(results)  # the RULER-style tasks: evaluate/ruler_report.py
    tasks += seed_sections(results)  # an experiment with seeds: over seeds, loss or counting L1
    for title, table in (lm if any(m.get("lengths") for m in results["models"]) else []) + tasks:
        if table:
            lines += ["", f"## {title}", "", table]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _interval_lines(results: dict) -> list[str]:
    """How the intervals were made (results written before intervals: a line saying there are none)."""
    method = results.get("settings", {}).get("intervals")
    if not method:
        return ["", "No intervals: these results do not keep the per-window values an interval is computed from "
                    f"(written before retrofit reported intervals, schema {md_inline(results.get('schema'))}); "
                    "n is shown."]
    return ["", f"Intervals: 95%, {md_inline(method)}. The unit of a loss interval is the window (L + 1 tokens of one "
                "document); `± h` is half the interval's width."]


def _comparison_section(results: dict) -> list[tuple[str, str]]:
    """One paired-differences table per reference with its legend; nothing without comparisons."""
    sections = []
    for reference in comparison_references(results):
        table = comparison_table_markdown(results, reference)
        if table:
            shown = md_inline(reference)
            sections.append((f"Paired differences to {shown}", f"Mean loss minus {shown}'s on the same "
                             f"windows, with the paired 95% interval (negative = lower loss than {shown})."
                             f"\n\n{table}\n\n{legend(results)}"))
    return sections
