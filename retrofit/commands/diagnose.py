"""`retrofit diagnose SOURCE... --data FILE --out DIR`: the paper's attention diagnostics on any model.

    retrofit diagnose runs/demo/base runs/demo/avnorm ./smollm2.gguf \\
        --data books/persuasion.txt --lengths 32,64,...,1024 --out diag/
    retrofit diagnose ./smollm2.gguf --patch avnorm --calibrate-tokens 8192 --data book.txt --out diag/

Parses the command line into a `DiagnoseSpec` and calls `retrofit.diagnose.diagnose_sources`.
"""

from __future__ import annotations

import shlex
import sys

from ..lengths import parse_lengths
from . import (
    add_dtype_flag,
    add_patch_flag,
    add_progress_flag,
    check_counts,
    check_out,
    check_text_files,
)

DEFAULT_LENGTHS = "32,64,...,1024"


def add_arguments(parser) -> None:
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="model: Hub id, folder or .gguf file")
    parser.add_argument("--data", required=True, help="a plain-text file (long enough for the windows)")
    parser.add_argument("--out", required=True, help="output folder: diagnose.json, report.md, *.png")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"context lengths L (default {DEFAULT_LENGTHS})")
    parser.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: each model's own)")
    parser.add_argument("--windows", type=int, default=2, help="text windows of max(L) tokens (default 2)")
    parser.add_argument("--queries", type=int, default=8, help="query rows measured per length (default 8)")
    add_patch_flag(parser, "also diagnose each source patched this way (repeatable), e.g. avnorm or psoftmax:p=2",
                   repeatable=True)
    parser.add_argument("--calibrate-tokens", type=int, default=8192,
                        help="tokens of --data (after the windows) that calibrate avnorm gains (default 8192; 0: none)")
    parser.add_argument("--label", action="append", default=[], help="a name per source, in order")
    add_dtype_flag(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed for the random directions of g(T, eps)")
    add_progress_flag(parser)


def run(args) -> int:
    from ..bounds import MOST, check_size
    from ..diagnose import DiagnoseSpec, diagnose_sources

    check_counts(args, positive=("windows", "queries"), nonnegative=("calibrate_tokens",))
    for name in ("windows", "queries"):  # before any text is read: every window and row is kept in diagnose.json
        check_size(getattr(args, name), f"--{name}", MOST[name])
    args.out = check_out(args.out, "--out", empty=False)  # `~` expanded, once
    check_text_files([args.data], "--data")
    lengths = parse_lengths(args.lengths)
    command = " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["diagnose"] else "..."
    spec = DiagnoseSpec(data=args.data, out=args.out, lengths=lengths, tokenizer=args.tokenizer, windows=args.windows,
                        queries=args.queries, patches=args.patch, calibrate_tokens=args.calibrate_tokens,
                        labels=args.label or None, dtype=args.dtype, seed=args.seed, progress=not args.no_progress,
                        command=command)
    diagnose_sources(args.sources, spec)
    return 0
