"""`retrofit bench <name> [options]`: benchmarks that print a table and write JSON (retrofit/bench/).

    retrofit bench attention --seq 1024,4096,16384 --heads 8 --dim 64 --out bench-attention.json
    retrofit bench train --model-type llama --norm avnorm
    retrofit bench eval --length 16384
    retrofit bench decode MODEL --prompt-tokens 2048 --new-tokens 64   # KV-cache decoding, each norm vs unpatched
    retrofit bench gpu --out bench-results/gpu                          # the one-call GPU run (parity, speed, train)
    retrofit bench attention --help                  # each benchmark's own options

Each benchmark is a module named in BENCHES providing `add_arguments(parser)` and `run(args) -> int`;
it is imported only when asked for, so one benchmark's heavy imports never slow another. Bad options
raise `RetrofitError` (the CLI prints one line and exits 2).
"""

from __future__ import annotations

import argparse
import importlib
import os

from ..errors import RetrofitError
from . import check_counts, check_out, check_out_file

BENCHES = {
    "attention": "retrofit.bench.attention",
    "train": "retrofit.bench.train",
    "eval": "retrofit.bench.eval",
    "decode": "retrofit.bench.decode",
    "gpu": "retrofit.bench.gpu",
}
# integer options of the benchmarks that must be >= 1 (checked whichever benchmark has them)
COUNTS = ("heads", "dim", "batch", "repeats", "timeout", "length", "chunk_tokens", "seq_len", "steps", "warmup",
          "threads", "prompt_tokens", "new_tokens", "sequence_parallel")


class _RaisingParser(argparse.ArgumentParser):
    """A benchmark's own parser: a usage error becomes a one-line RetrofitError instead of an exit."""

    def error(self, message):
        raise RetrofitError(f"{message} (see `{self.prog} --help`)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench", metavar="NAME", help="which benchmark: " + ", ".join(BENCHES))
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="the benchmark's own options (see `retrofit bench NAME --help`)")


def load(name: str):
    """The module of benchmark `name` (every one in BENCHES ships: test_bench imports each); RetrofitError when
    the name is unknown."""
    if name not in BENCHES:
        raise RetrofitError(f"unknown benchmark {name!r}; available: {', '.join(BENCHES)}")
    return importlib.import_module(BENCHES[name])


def _check_out(out, module) -> str:
    """A benchmark's --out, `~` expanded once: a JSON file ("file"), a file or an existing folder to write the
    benchmark's FILE_NAME into ("file-or-folder"), or a folder that must be new or empty ("folder": the benchmark
    writes several files there)."""
    kind = getattr(module, "OUT_KIND", "file")
    if kind == "folder":
        return check_out(out)
    if kind == "file-or-folder" and not os.path.islink(os.path.expanduser(str(out))):  # a link: refused below
        check_out_file(module.out_path(out))
        return os.path.expanduser(str(out))
    return check_out_file(out)


def run(args: argparse.Namespace) -> int:
    module = load(args.bench)
    doc = (module.__doc__ or "").strip().splitlines()
    parser = _RaisingParser(prog=f"retrofit bench {args.bench}", description=doc[0] if doc else None)
    module.add_arguments(parser)
    options = parser.parse_args(args.options)
    check_counts(options, positive=COUNTS)
    if getattr(options, "out", None):
        options.out = _check_out(options.out, module)  # `~` expanded, once
    return int(module.run(options) or 0)
