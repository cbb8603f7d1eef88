"""`retrofit experiment RECIPE --out DIR` and `retrofit demo`: base -> arms -> evaluation -> report.

    retrofit experiment recipes/llama-avnorm-retrofit.yaml --out runs/smollm2
    retrofit demo                                   # recipes/demo.yaml: offline, CPU, minutes

Parses the command line and calls `retrofit.experiment.run_experiment`, then prints the summary table.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import add_progress_flag, check_out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe with an experiment section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. experiment.finetune_steps=50")
    parser.add_argument("--out", required=True, help="experiment folder (re-run to resume)")
    _add_progress(parser)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides of recipes/demo.yaml")
    parser.add_argument("--out", default="runs/demo", help="experiment folder (default runs/demo)")
    _add_progress(parser)


def _add_progress(parser: argparse.ArgumentParser) -> None:
    add_progress_flag(parser, "no progress bars, training or evaluation (train.progress=false): for logs and files")


def run(args) -> int:
    from ..experiment import run_experiment

    recipe = _checked_recipe(args.recipe, args)
    _print_summary(run_experiment(recipe, args.out, progress=not args.no_progress), Path(args.out))
    return 0


def _checked_recipe(path, args):
    """The recipe with its overrides, refused when --out cannot do (run_experiment checks the recipe itself)."""
    from ..recipe import load_recipe

    args.out = check_out(args.out, "--out", empty=False)  # an experiment folder (made by retrofit) is resumed
    return load_recipe(path, [*args.overrides, *(["train.progress=false"] if args.no_progress else [])])


def run_demo(args) -> int:
    """`retrofit demo`: the embedded default experiment (recipes/demo.yaml), offline, on the CPU."""
    import torch

    from ..experiment import DEMO_RECIPE, run_experiment

    if not os.environ.get("OMP_NUM_THREADS"):  # a shared machine's OMP_NUM_THREADS is kept (torch read it)
        torch.set_num_threads(max(1, os.cpu_count() or 1))  # else every core: torch's default is the physical ones
    recipe = _checked_recipe(DEMO_RECIPE, args)
    _print_summary(run_experiment(recipe, args.out, progress=not args.no_progress), Path(args.out))
    return 0


CLI_COMMANDS = {"experiment": (add_arguments, run), "demo": (add_demo_arguments, run_demo)}


def _print_summary(results: dict, out: Path) -> None:
    from ..experiment import summary_table

    print()
    print(summary_table(results))
    print(f"\nreport: {out / 'report.md'}   (results.json, eval/, base/, arms/ beside it)")
