"""What `retrofit eval` does, as functions: score models (or merge finished results) into a folder of reports.

    from retrofit.evaluate import EvalSpec
    from retrofit.evaluate.folder import evaluate_into, merge_into, result_tables

    outcome = evaluate_into(["runs/base", "runs/avnorm"], EvalSpec(data=["book.txt"], lengths="256,...,4096"), "eval")
    print(result_tables(outcome.results))      # the loss, cost and paired-difference tables `retrofit eval` prints
    outcome.paths                              # results.json, results.csv, results.md and the plots, written
    merge_into(["eval-16k/results.json", "eval-32k/results.json"], "eval", reference="softmax")  # nothing re-scored

The folder is new, empty or made by retrofit (retrofit.atomic.output_folder: its marker, its lock: one writer at a
time); every check that needs no model (the names, the reference; the merged files read) comes before it is made.
commands/eval.py parses the flags into an EvalSpec, checks the folder can be written, calls one of these and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..io.atomic import output_folder


@dataclass
class EvalOutcome:
    """What evaluate_into and merge_into wrote: the results dict (docs/results-schema.md) and the report's files."""

    results: dict
    paths: list[Path]


def evaluate_into(models: list[str], spec, out) -> EvalOutcome:
    """evaluate_models(models, spec), then the report written into `out` (a wrong name count or reference fails
    before `out` is made)."""
    from . import evaluate_models, evaluation_names  # the package's names: what a test (or a caller) replaces
    from .report import write_report

    evaluation_names(models, spec)  # a wrong --names count or --reference fails before --out is made
    with output_folder(out, "--out"):  # one `eval --out X` at a time
        results = evaluate_models(models, spec)
        paths = write_report(results, out)
    return EvalOutcome(results, paths)


def merge_into(files: list, out, reference: str | None = None) -> EvalOutcome:
    """Finished results.json files as one report in `out` (retrofit.evaluate.merge), judged against `reference`;
    every file is read and checked before `out` is made."""
    from .merge import merge_results
    from .report import write_report

    results = merge_results(files, reference)
    with output_folder(out, "--out"):
        paths = write_report(results, out)
    return EvalOutcome(results, paths)


def result_tables(results: dict) -> str:
    """The tables `retrofit eval` prints: loss and cost by length, then the paired differences to each reference
    ("" when there are none)."""
    from .compare import comparison_references
    from .report import APPROX_LEGEND, comparison_table_markdown, cost_table_markdown, loss_table_markdown

    blocks = []
    if any(m["lengths"] for m in results["models"]):
        blocks.append(loss_table_markdown(results) + "\n\n" + cost_table_markdown(results))
    for reference in comparison_references(results):
        if comparison_table_markdown(results, reference):
            blocks.append(f"\nPaired differences to {reference}\n" + comparison_table_markdown(results, reference)
                          + "\n" + APPROX_LEGEND)
    return "\n".join(blocks)
