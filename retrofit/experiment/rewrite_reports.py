"""What `retrofit report` does, as one function: finished results folders judged again and their reports rewritten.

    from retrofit.experiment.rewrite_reports import rejudge_folders

    rejudge_folders(["docs/results/x", "runs/v3"])                      # each folder's reports rewritten in place
    rejudge_folders(["runs/v3"], reference="base", out="runs/v3/vs-base")  # one evaluation against base, elsewhere
    rejudge_folders(["docs/results/x"], margin=0.02, say=None)          # an equivalence margin; silent

A folder holds an evaluation (`retrofit eval`'s results.json) or an experiment (results.json + eval/, report.md);
every interval and paired difference is recomputed with retrofit.evaluate.rejudge from the per-unit values the
results keep. It lives here, not in evaluate, because an experiment's report.md is experiment.report's to write.
Every results.json is read and checked before any is rewritten; then every folder's ownership (its marker) is checked
and every folder's lock taken, so a run writing one of them refuses us instead of racing. A refusal names the
command's flags (margin is --margin, out is --out).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Callable

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text, check_output, folder_lock, output_folder


def rejudge_folders(folders: list, *, reference: str | None = None, out: str | None = None,
                    margin: float | None = None, say: Callable[[str], Any] | None = print) -> list[Path]:
    """Judge each folder's results again (see the module docstring); the folders written. With `out` (and
    `reference`, names of models or arms joined by commas): one folder's evaluation judged against them, written into
    `out` (a new folder) instead. say: one line per folder written."""
    from ..evaluate.rejudge import rejudge
    from ..evaluate.report import write_report

    say = say or (lambda line: None)
    if margin is not None and not (math.isfinite(margin) and margin > 0):
        raise RetrofitError(f"--margin must be a number of nats > 0, e.g. 0.02, got {margin:g}")
    paths = [Path(f) / "results.json" for f in folders]
    loaded = [(path, read_results_folder(path)) for path in paths]  # every file read and checked before any write
    if out is not None or reference is not None:
        if out is None or len(loaded) != 1:
            raise RetrofitError("--reference and --out go together, with one folder: retrofit report DIR "
                                "--reference NAME --out NEW")
        results = loaded[0][1]
        judged = rejudge(results.get("evaluation", results), reference, margin)  # an unknown name: one line
        with output_folder(out, "--out") as folder:
            write_report(judged, folder)
        say(f"report: {out} (against {reference})")
        return [Path(out)]
    for path, _ in loaded:  # rewritten in place only where retrofit owns the folder (its marker), all checked first
        check_output(path.parent, "report DIR")  # ... and holds no link out of it
    with contextlib.ExitStack() as locks:  # every folder's lock, before any is rewritten: a run writing it refuses us
        for path, _ in loaded:
            locks.enter_context(folder_lock(path.parent))
        for path, results in loaded:
            if results.get("schema", "").startswith("retrofit.experiment/"):
                rejudge_experiment(path.parent, results, margin)
            else:
                write_report(rejudge(results, margin=margin), path.parent)
            say(f"report: {path.parent} judged again")
    return [path.parent for path, _ in loaded]


def read_results_folder(path: Path) -> dict:
    """A folder's results.json (`path`), checked: an evaluation's or an experiment's; a one-line error otherwise."""
    from ..evaluate.merge import checked_results
    from ..evaluate.report import validate
    from ..io.readers import expect, read_json

    if not path.is_file():
        raise RetrofitError(f"{path.parent} has no results.json: give a folder retrofit eval or experiment wrote")
    results = read_json(path)  # a mapping (a list, a 5,000-digit number: one line)
    if not str(results.get("schema", "")).startswith("retrofit.experiment/"):
        return checked_results(results, str(path))
    try:
        validate(results["evaluation"])
        for name, arm in expect(results["arms"], dict, "its arms").items():  # the report reads each arm's fields
            expect(arm, dict, f"arm {name!r}")
    except (KeyError, RetrofitError) as err:
        raise RetrofitError(f"{path}: not a retrofit experiment results.json ({err})") from None
    return results


def rejudge_experiment(out: Path, results: dict, margin: float | None = None) -> None:
    """An experiment folder judged again: eval/, results.json and report.md, against its control when it was
    evaluated (the control may have failed)."""
    from ..evaluate.rejudge import rejudge
    from ..evaluate.report import write_report
    from .report import results_control, write_experiment_report

    control = results_control(results)  # experiment.control (older results.json: its documented fallback)
    evaluated = any(control in (m["name"], m.get("arm")) for m in results["evaluation"]["models"])
    results = dict(results, evaluation=rejudge(results["evaluation"], control if evaluated else None, margin))
    write_report(results["evaluation"], out / "eval")
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    write_experiment_report(results, out)
