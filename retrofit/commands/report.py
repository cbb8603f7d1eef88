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

Parses the command line and calls `retrofit.experiment.rewrite_reports.rejudge_folders`, which prints a line per
folder.
"""

from __future__ import annotations


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
    from ..experiment.rewrite_reports import rejudge_folders  # the library when the verb runs: `--help` stays fast

    rejudge_folders(args.folders, reference=args.reference, out=args.out, margin=args.margin, say=print)
    return 0
