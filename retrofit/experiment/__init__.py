"""The retrofit experiment: one base checkpoint -> finetuned arms -> length evaluation -> report.

    from retrofit.experiment import run_experiment
    results = run_experiment("recipes/llama-avnorm-retrofit.yaml", "runs/smollm2")

Modules: driver (the stages, resumable), results (the evaluation, results.json), report (report.md, recovery plot,
summary table), reference (comparison with a published table), rewrite_reports (finished folders judged again: retrofit
report). The schema is retrofit/recipe/experiment_section.py; the CLI
is retrofit/commands/experiment.py. It only chains train, evaluate and report; it owns no training or evaluation
logic.
"""

from .driver import DEMO_RECIPE, run_arm, run_base, run_experiment
from .report import hardware, summary_table, write_experiment_report
from .rewrite_reports import rejudge_folders

__all__ = ["DEMO_RECIPE", "hardware", "rejudge_folders", "run_arm", "run_base", "run_experiment",
           "summary_table", "write_experiment_report"]
