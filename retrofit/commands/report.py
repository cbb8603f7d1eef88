"""`retrofit report DIR...`: judge finished results again, without re-scoring anything.

    retrofit report docs/results/smollm2-longctx-intervals          # an evaluation folder (results.json)
    retrofit report runs/v3                                          # an experiment folder (results.json + eval/)
    retrofit report runs/v3 --reference base --out runs/v3/vs-base   # its evaluation against another model
    retrofit report docs/results/x --margin 0.02                     # declare an equivalence margin: ≡ = matches

Every interval and paired difference is recomputed from the per-window losses (and other per-unit values) the
results keep, with retrofit.evaluate.intervals, and the folder's reports are rewritten in place (only in a folder
retrofit made, with its marker; an older one after `retrofit adopt DIR`): results.json,
results.csv, results.md and the plots; for an experiment also eval/ and report.md. Use it after a change to how
retrofit judges numbers; `retrofit eval --merge` puts several evaluations side by side.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text, check_output, folder_lock, output_folder


def add_arguments(parser):
    parser.add_argument("folders", nargs="+", metavar="DIR",
                        help="folders holding a results.json written by retrofit eval or retrofit experiment")
    parser.add_argument("--reference", metavar="NAME[,NAME...]", default=None,
                        help="with --out: compare every model with these (a model, or an experiment's arm)")
    parser.add_argument("--out", default=None, help="write one folder's evaluation, judged against --reference, "
                                                    "here (a new folder) instead of rewriting the folder")
    parser.add_argument("--margin", type=float, default=None, metavar="NATS",
                        help="declare an equivalence margin: a paired difference whose 90%% interval lies inside "
                             "±NATS (two one-sided t tests at 5%%) is marked ≡, 'matches' (e.g. 0.02); kept in "
                             "results.json, so later reports keep it")


def run(args) -> int:
    from ..evaluate.rejudge import rejudge  # the library when the verb runs: `retrofit report --help` stays fast
    from ..evaluate.report import write_report

    if args.margin is not None and not (math.isfinite(args.margin) and args.margin > 0):
        raise RetrofitError(f"--margin must be a number of nats > 0, e.g. 0.02, got {args.margin:g}")
    paths = [Path(f) / "results.json" for f in args.folders]
    loaded = [(path, _read(path)) for path in paths]  # every file is read and checked before any is rewritten
    if args.out is not None or args.reference is not None:
        if args.out is None or len(loaded) != 1:
            raise RetrofitError("--reference and --out go together, with one folder: retrofit report DIR "
                                "--reference NAME --out NEW")
        results = loaded[0][1]
        judged = rejudge(results.get("evaluation", results), args.reference, args.margin)  # unknown name: one line
        with output_folder(args.out, "--out") as out:
            write_report(judged, out)
        print(f"report: {args.out} (against {args.reference})")
        return 0
    for path, _ in loaded:  # rewritten in place only where retrofit owns the folder (its marker), all checked first
        check_output(path.parent, "report DIR")  # ... and holds no link out of it
    with contextlib.ExitStack() as locks:  # every folder's lock, before any is rewritten: a run writing it refuses us
        for path, _ in loaded:
            locks.enter_context(folder_lock(path.parent))
        for path, results in loaded:
            if results.get("schema", "").startswith("retrofit.experiment/"):
                _experiment(path.parent, results, args.margin)
            else:
                write_report(rejudge(results, margin=args.margin), path.parent)
            print(f"report: {path.parent} judged again")
    return 0


def _read(path: Path) -> dict:
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


def _experiment(out: Path, results: dict, margin: float | None = None) -> None:
    from ..evaluate.rejudge import rejudge
    from ..evaluate.report import write_report
    from ..experiment.report import results_control, write_experiment_report  # only for experiment folders

    control = results_control(results)  # experiment.control (older results.json: its documented fallback)
    results = dict(results, evaluation=rejudge(results["evaluation"], control
                                               if _has(results["evaluation"], control) else None, margin))
    write_report(results["evaluation"], out / "eval")
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    write_experiment_report(results, out)


def _has(evaluation: dict, name) -> bool:
    """Whether `name` is one of the evaluation's models or arms (an experiment's control may have failed)."""
    return any(name in (m["name"], m.get("arm")) for m in evaluation["models"])
