"""The experiment's report.md: norm comparison by length, the recovery curve, hardware, time, failures.

Built only from the experiment's results dict (retrofit.experiment.run_experiment), with the tables
and plots of retrofit.evaluate.report; the per-length evaluation report sits beside it in eval/.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ..evaluate.compare import comparison_references
from ..evaluate.intervals import plus_minus
from ..evaluate.report import comparison_table_markdown, legend, line_plot, markdown_table, seed_sections
from ..evaluate.tail import tail_sections
from ..io.atomic import atomic_write_text
from ..io.escape import md_code, md_inline
from ..norms import baseline_norm
from ..recipe import seeded_name
from .reference import direction_markdown


def hardware() -> dict:
    """The machine a stage ran on, as the report's Hardware line shows it."""
    from transformers import __version__ as transformers_version

    gpu = {"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {}
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),  # the numbers
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,  # move with these
            "transformers": transformers_version, **gpu}


def results_control(results: dict) -> str:
    """The experiment's control arm (experiment.control, recorded in results.json). A results.json written before
    `control` was recorded has none: its control arm then was the arm named after the baseline norm (experiment.
    control's default, baseline_norm()). The one place that fallback lives: `retrofit report` asks here too."""
    return results.get("control", baseline_norm())


def _metric(evaluation: dict) -> tuple[str, str]:
    """(key in each model's entry, label): counting runs report L1, language models next-token loss."""
    if any(m.get("counting") for m in evaluation["models"]):
        return "counting", "counting L1 (mean |predicted - true count|)"
    return "lengths", "mean next-token loss"


def by_length(evaluation: dict, value: str | None = None) -> dict[str, dict[int, float]]:
    """model name -> {length: metric} (default: counting L1 or next-token loss)."""
    key, _ = _metric(evaluation)
    value = value or ("l1" if key == "counting" else "loss")
    return {m["name"]: {r["length"]: r.get(value) for r in m.get(key) or []} for m in evaluation["models"]}


def intervals_by_length(evaluation: dict) -> dict[str, dict[int, tuple]]:
    """model name -> {length: (ci95, n)} of the default metric (loss, or counting L1): its interval (or None) and
    the units it stands on (windows or sequences)."""
    key, _ = _metric(evaluation)
    units = "sequences" if key == "counting" else "windows"
    return {m["name"]: {r["length"]: (r.get("ci95"), r.get(units)) for r in m.get(key) or []}
            for m in evaluation["models"]}


def _fmt(x, interval=None) -> str:
    """A value, with `± half-width (n=N)` when `interval` is a (ci95, n) pair."""
    if x is None:
        return "—"
    if interval is not None and abs(x) < 1000:
        return plus_minus(x, *interval)
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.3g}"


def comparison_table(results: dict, value: str | None = None) -> str:
    """Rows base + arms, columns lengths (the trained one starred), plus ratio of longest to trained; values
    carry `± half-width (n=N)` of their 95% interval and the units it stands on."""
    evaluation = results["evaluation"]
    table = by_length(evaluation, value)
    intervals = intervals_by_length(evaluation) if value is None else {}  # ± only on the metric they measure
    lengths, train_len = evaluation["lengths"], evaluation.get("train_len")
    header = ["model", "patch"] + [f"{n}{'*' if n == train_len else ''}" for n in lengths]
    if train_len in lengths and len(lengths) > 1:
        header.append(f"{lengths[-1]} / {train_len}")
    rows = []
    for name, values in table.items():
        patch = results["arms"].get(name, {}).get("patch") if name != "base" else {"norm": f"{baseline_norm()} (base)"}
        row = [name, ", ".join(f"{k}={v}" for k, v in (patch or {}).items() if v not in (None, False))]
        row += [_fmt(values.get(n), intervals.get(name, {}).get(n)) for n in lengths]
        if train_len in lengths and len(lengths) > 1:
            lo, hi = values.get(train_len), values.get(lengths[-1])
            row.append(f"{hi / lo:.2f}x" if lo and hi is not None else "—")
        rows.append(row)
    return markdown_table(header, rows)


RECOVERY_METRICS = ("eval/loss@", "eval/l1@")


def recovery_lengths(results: dict) -> list[int]:
    """The lengths the arms' recovery curves were measured at (experiment.recovery_lengths)."""
    return sorted({int(k.rsplit("@", 1)[1]) for arm in results["arms"].values()
                   for metrics in (arm.get("recovery") or {}).values() for k in metrics
                   if k.startswith(RECOVERY_METRICS)})


def recovery_series(results: dict, length: int | None = None) -> dict[str, tuple[list, list]]:
    """arm -> (finetune steps, metric at `length`; default the shortest recovery length, the trained one)."""
    lengths = recovery_lengths(results)
    length = length if length is not None else (lengths[0] if lengths else None)
    series = {}
    for name, arm in results["arms"].items():
        points = sorted((int(step), metrics) for step, metrics in (arm.get("recovery") or {}).items())
        values = [(s, next((m[k + str(length)] for k in RECOVERY_METRICS if k + str(length) in m), None))
                  for s, m in points]
        values = [(s, v) for s, v in values if v is not None]
        if values:
            series[name] = ([s for s, _ in values], [v for _, v in values])
    return series


def gap_series(results: dict, length: int | None = None) -> dict[str, tuple[list, list]]:
    """arm -> (steps, metric minus the control arm's at the same step), for every arm but the control (with seeds:
    each run minus the control's run under the same seed); empty when no arm is named experiment.control (or it
    failed)."""
    series = recovery_series(results, length)
    gaps = {}
    for name, (steps, values) in series.items():
        control = _control_run(results, name)
        if name != control and control in series:
            at = dict(zip(*series[control]))
            pairs = [(s, v - at[s]) for s, v in zip(steps, values) if s in at]
            if pairs:
                gaps[name] = ([s for s, _ in pairs], [g for _, g in pairs])
    return gaps


def _control_run(results: dict, name: str) -> str:
    """The control's run a run is compared with: the control arm, under the run's own seed when it has one."""
    control, seed = results_control(results), results["arms"].get(name, {}).get("seed")
    return control if seed is None else seeded_name(control, seed)


def _steps_table(series: dict, corner: str, fmt=None) -> str:
    fmt = fmt or _fmt
    steps = sorted({s for xs, _ in series.values() for s in xs})
    rows = [[name] + [fmt(dict(zip(xs, ys)).get(s)) for s in steps] for name, (xs, ys) in series.items()]
    return markdown_table([corner] + [str(s) for s in steps], rows) if rows else ""


def _from_scratch(results: dict) -> bool:
    """No base: every arm trained from its seed's init (model.config), so its steps are training, not finetuning."""
    return results.get("base") is None


def _stage(results: dict) -> str:
    return "training" if _from_scratch(results) else "finetune"


def design_sentence(results: dict) -> str:
    """The report's first line, from the results themselves: from scratch or from a base, the seeds, and the
    learning rate of every arm that names its own."""
    scratch = "Every arm trained from scratch (no shared base; arms under one seed start from one init)"
    start = scratch if _from_scratch(results) else "Base checkpoint, then every arm finetuned from it"
    seeds = results.get("seeds")
    seeded = (f", once under each training seed {md_inline(seeds)} (runs paired by seed)" if seeds
              else ", with the same seed unless an arm names its own (recipe.yaml)")
    rates = {n: a["settings"]["lr"] for n, a in results["arms"].items()
             if (a.get("settings") or {}).get("lr") is not None}
    own = ", ".join(f"{md_inline(n)} {lr:g}" for n, lr in rates.items())
    lr = f"; arms with their own learning rate: {own} (the others: the recipe's)" if rates else ""
    return (f"{start}, for the same steps on the same data{seeded}{lr}. Then every run is evaluated at every "
            "length. Numbers are computed by this run, not copied.")


def recovery_table(results: dict, length: int | None = None) -> str:
    return _steps_table(recovery_series(results, length), f"arm \\ {_stage(results)} step")


def gap_table(results: dict, length: int | None = None) -> str:
    return _steps_table(gap_series(results, length), f"gap to {results_control(results)} \\ step",
                        lambda x: "—" if x is None else f"{x:+.3f}")


def summary_table(results: dict) -> str:
    """The short table `retrofit demo` prints: metric by length, per model."""
    key, label = _metric(results["evaluation"])
    text = f"{label} by length (* = trained length)\n" + comparison_table(results)
    if key == "counting":
        text += ("\n\nL1 relative to the mean true count (counts grow with length)\n"
                 + comparison_table(results, "relative_l1"))
    return text


def write_experiment_report(results: dict, out) -> Path:
    out = Path(out)
    evaluation = results["evaluation"]
    _, label = _metric(evaluation)
    lengths = recovery_lengths(results)
    plots = []
    if lengths:
        colors = {m["name"]: f"C{i % 10}" for i, m in enumerate(evaluation["models"])}  # as in eval/'s plots
        for i, n in enumerate(lengths):
            gaps = gap_series(results, n)
            name = "recovery.png" if i == 0 else f"recovery-{n}.png"
            series = gaps or recovery_series(results, n)
            what = f"gap to {results_control(results)} at {n}" if gaps else f"{label} at {n}"
            title = f"Held-out {label} at {n} tokens" if _from_scratch(results) else f"Retrofit recovery at {n} tokens"
            plots.append(line_plot(series, out / name, xlabel=f"{_stage(results)} steps", log2x=False, colors=colors,
                                   ylabel=what, title=title).name)
    eval_plots = [p.name for p in sorted((out / "eval").glob("*.png"))]
    failed = {n: a["failed"] for n, a in results["arms"].items() if a.get("failed")}
    # what results.json says is shown as text (`retrofit report DIR` rebuilds this file from it)
    lines = [f"# Experiment: {md_inline(results['recipe'])}", "",
             design_sentence(results), "",
             f"- Hardware: {md_inline(json.dumps(results['hardware']))}",
             f"- Wall time (s): {md_inline(json.dumps(results['wall_time_s']))}, total "
             f"{sum(v or 0 for v in results['wall_time_s'].values()) / 60:.1f} min (a stage a re-run skipped "
             "keeps the time recorded when it ran)",
             f"- Base: {_bases(results['base'])}",
             f"- Failed or diverged arms: {md_inline(json.dumps(failed)) if failed else 'none'}", "",
             f"## {label} by context length", "", "`*` marks the trained length; the last column is the "
             "longest length's value divided by the trained length's.", "", comparison_table(results), ""]
    lines += _paired_gap_lines(evaluation)
    lines += _train_vs_heldout_lines(results)
    for title, table in seed_sections(evaluation) + tail_sections(evaluation):  # over seeds; the post's metric
        lines += [f"### {title}", "", table, ""]
    if _metric(evaluation)[0] == "counting":
        lines += ["### L1 relative to the mean true count", "",
                  "The count to predict grows with the length, so absolute L1 grows even for a model that "
                  "extrapolates; L1 / mean count is flat for one that does.", "",
                  comparison_table(results, "relative_l1"), ""]
    for plot, n in zip(plots, lengths):
        gaps = gap_table(results, n)
        during = "training (from scratch)" if _from_scratch(results) else "finetuning"
        lines += [f"## Recovery at {n} tokens: {label} during {during}", "", recovery_table(results, n), ""]
        if gaps:
            lines += [f"Gap to the control arm {md_code(results_control(results))} at the same step "
                      "(negative = better than the control):", "", gaps, ""]
        lines += [f"![recovery at {n}]({plot})", ""]
    if results.get("reference"):
        lines += direction_markdown(results["reference"], by_length(evaluation), evaluation.get("train_len"))
    lines += ["## Plots", ""] + [f"![{p}](eval/{p})" for p in eval_plots]
    lines += ["", "Per-length details (windows, tokens, time, memory, by-position): "
                  "[eval/results.md](eval/results.md)."]
    return atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def _train_vs_heldout_lines(results: dict) -> list[str]:
    """Each run's training loss (its last log window) beside its evaluation at the trained length: a held-out value
    far above the training one is overfitting (the data seen many times), not a property of the norm."""
    evaluation = results["evaluation"]
    train_len, table = evaluation.get("train_len"), by_length(evaluation)
    rows = []
    for name, arm in results["arms"].items():
        train, held_out = arm.get("train_loss"), table.get(name, {}).get(train_len)
        if train is not None and held_out is not None:
            rows.append([name, _fmt(train), _fmt(held_out), f"{held_out - train:+.3f}"])
    if not rows:
        return []
    _, label = _metric(evaluation)
    return [f"### Training vs evaluation at the trained length ({train_len})", "",
            f"{label}: the training loss is the mean over the run's last log window (train.log_every steps of "
            "training batches); the evaluation is the table above at the trained length.", "",
            markdown_table(["run", "training", f"evaluation at {train_len}", "evaluation - training"], rows), ""]


def _paired_gap_lines(evaluation: dict) -> list[str]:
    """The gap of each model to the control arm by length, paired over the same windows, with its 95% interval
    (evaluation['comparisons'], reference = the control; with seeds, one table per seed's control run); nothing
    when the evaluation has no comparisons."""
    lines = []
    for reference in comparison_references(evaluation):
        table = comparison_table_markdown(evaluation, reference)
        if table:
            lines += [f"### Gap to {md_code(reference)} by length (paired, same windows)", "",
                      f"Mean loss minus {md_code(reference)}'s on the same windows, with the 95% interval of the "
                      "per-window differences (negative = better than it).", "", table, "", legend(evaluation), ""]
    return lines


def _bases(base) -> str:
    """The base checkpoint, or with experiment.base_per_seed one per seed."""
    if isinstance(base, dict):
        return "one per seed: " + ", ".join(md_code(b) for b in base.values())
    return md_code(base)
