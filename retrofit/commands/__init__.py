"""One module per CLI verb: `retrofit <verb>` is `retrofit/commands/<verb>.py`.

Each module provides `add_arguments(parser)` and `run(args) -> int`, parses the command line, calls the library's
one function for the mode asked (patch: run_patch_job; eval: evaluate_into, --merge: merge_into; report:
rejudge_folders) and prints what it returns; it writes no file itself and loops only to print or to check its flags
(tests/cli/test_thin_commands.py). retrofit/cli.py maps verbs to modules. Outside commands/, argparse is used only
by the benchmarks (`bench` parses a benchmark's name and hands the rest of the command line to that retrofit/bench
module's own add_arguments and run(args)) and by serve/parity's own `python -m` entry point.
The checks of the command line every verb makes at the top of `run`, before loading anything, live here: counts
that must be positive, an output path we can write, text files that can be read; so do the flags several verbs
share (one spelling everywhere: --no-progress, --dtype, --patch). What a recipe or a model would refuse (a missing
data file, a damaged source, activations that do not fit in memory) is the library's to check, in its entry points
(retrofit.train.recipe_fits, retrofit.load.preflight): a Python caller gets the same refusal as the command line.

A verb module imports nothing heavy at its top (torch, transformers, the library): `retrofit VERB --help` and an
argument error then take a fraction of a second; `run` imports what it uses (tests/cli/test_cli_habits.py checks).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from ..errors import RetrofitError, check_utf8
from ..io.atomic import check_output, output_path

# the names retrofit.load.models.as_dtype takes (that module imports torch: the parser must not)
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def add_progress_flag(parser, what: str = "no progress bars") -> None:
    """--no-progress, in every verb that shows progress (--quiet: diagnose's old spelling, hidden)."""
    parser.add_argument("--no-progress", action="store_true", help=what)
    parser.add_argument("--quiet", dest="no_progress", action="store_true", help=argparse.SUPPRESS)


def _dtype(name: str) -> str:
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use auto (the saved dtype) or one of "
                                         f"{', '.join(DTYPES[1:])}")
    return name


def add_dtype_flag(parser) -> None:
    """--dtype, default auto (the dtype the model was saved in), in every verb that loads a model."""
    parser.add_argument("--dtype", default="auto", type=_dtype,
                        help="auto (default: the dtype each model was saved in) | float32 | bfloat16 | float16")


def add_patch_flag(parser, help: str, repeatable: bool = False) -> None:
    """--patch NORM[:KEY=VALUE,...] (retrofit.patch_spec.PatchSpec.parse reads it), in eval and diagnose."""
    parser.add_argument("--patch", metavar="NORM[:KEY=VALUE,...]", help=help,
                        **({"action": "append", "default": []} if repeatable else {"default": None}))


def check_counts(args, positive=(), nonnegative=()) -> None:
    """--trials 0, --check-tokens -5 ...: one line naming the flag, before any work."""
    for names, least in ((positive, 1), (nonnegative, 0)):
        for name in names:
            value = getattr(args, name, None)
            if value is not None and value < least:
                raise RetrofitError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def check_out_file(path, flag: str = "--out") -> str:
    """An output *file* (a benchmark's JSON): not a folder, not a symbolic link, in a folder we can write.
    Returns the path with `~` expanded: use it from here on."""
    out = output_path(path)
    if out.is_symlink():
        raise RetrofitError(f"{flag} {path} is a symbolic link; give the real file path")
    if out.is_dir():
        raise RetrofitError(f"{flag} {path} is a folder; give a file path, e.g. {Path(path) / 'bench.json'}")
    _check_writable(out.parent, flag, path)
    return str(out)


def check_text_files(paths, flag: str) -> None:
    """Each file exists, is a file, is not empty and is UTF-8 (the one text rule: retrofit.errors.check_utf8)."""
    for path in paths:
        check_utf8(path, flag)
        if Path(os.path.expanduser(str(path))).stat().st_size == 0:
            raise RetrofitError(f"{flag} {path} is empty; give a file with text in it")


def check_out(path, flag: str = "--out", *, empty: bool = True):
    """The output-folder rule (retrofit.io.atomic.check_output: new, empty, or made by retrofit; with `empty`, new or
    empty), and a place we can write; returns the path with `~` expanded (None for None): use it from here on."""
    if path is None:
        return None
    out = check_output(path, flag, empty=empty)
    _check_writable(out, flag, path)
    return str(out)


def _check_writable(out: Path, flag: str, path) -> None:
    """A folder can be made at `out` (or it exists): its nearest existing ancestor is a writable folder."""
    parent = out
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent  # the nearest folder that exists: the one we would create ours in
    if not parent.is_dir():
        raise RetrofitError(f"{flag} {path}: {parent} is a file, so no folder can be made under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RetrofitError(f"{flag} {path}: {parent} is not writable; choose a folder you can write to")


@contextlib.contextmanager
def library_bars(show: bool):
    """transformers' and huggingface_hub's own progress bars (GGUF conversion, "Writing model shards", downloads) off
    inside the block unless `show` (--no-progress means every bar, issue 62); as they were, after."""
    if show:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hub_was_off, hf_was_on = are_progress_bars_disabled(), hf_logging.is_progress_bar_enabled()
    disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not hub_was_off:
            enable_progress_bars()
        if hf_was_on:
            hf_logging.enable_progress_bar()
