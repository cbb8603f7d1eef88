"""One module per CLI verb: `retrofit <verb>` is `retrofit/commands/<verb>.py`.

Each module provides `add_arguments(parser)` and `run(args) -> int`, parses the command line, calls one
library function and prints; no library module uses argparse (retrofit/cli.py maps verbs to modules).
The checks every verb makes at the top of `run`, before loading anything, live here: counts that must be
positive, an output path we can write, and activations that fit in memory; so do the flags several verbs share
(one spelling everywhere: --no-progress, --dtype, --patch).

A verb module imports nothing heavy at its top (torch, transformers, the library): `retrofit VERB --help` and an
argument error then take a fraction of a second; `run` imports what it uses (tests/cli/test_cli_habits.py checks).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..atomic import check_output, output_path
from ..errors import RetrofitError, check_utf8

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
    """The output-folder rule (retrofit.atomic.check_output: new, empty, or made by retrofit; with `empty`, new or
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


def device_for_memory():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_model(source) -> None:
    """What loading `source` would refuse, found without loading it: an unfinished run, a damaged
    config.json or safetensors file, a malformed `retrofit` section."""
    from ..load import check_finished, check_model_files, source_kind
    from ..load.checkpoint import is_checkpoint

    check_finished(source)
    kind = source_kind(source)
    if kind == "folder":
        check_model_files(os.path.expanduser(str(source)))
        if (Path(os.path.expanduser(str(source))) / "config.json").is_file():
            is_checkpoint(source)  # raises on a malformed retrofit section
    elif kind == "hub":
        is_checkpoint(source)


def check_recipe(recipe) -> None:
    """Before the model is built: the data files (retrofit.data.text.check_files), and memory: training
    (data.seq_len x train.micro_batch_size) and its evaluation (the longest eval length x eval.batch_size)
    must fit (retrofit.memory.check_fits)."""
    from ..data.text import check_files
    from ..load import load_config
    from ..memory import check_fits

    check_files(recipe.data)  # before any model is loaded: a bad file list fails in a second
    m = recipe.model
    if m.source is not None:
        check_model(m.source)
        config = load_config(m.source, m.revision)
    elif m.config and "model_type" in m.config:
        from transformers import AutoConfig
        cfg = dict(m.config)
        try:
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        except (ValueError, TypeError):
            return  # building the model reports a bad config in its own words
    else:
        return
    patches = [(recipe.patch, "patch")]
    exp = recipe.section("experiment")
    patches += [(arm.patch, f"experiment arm {arm.name}: patch") for arm in (exp.arms if exp is not None else [])]
    check_selection_counts(config, [(getattr(section, key), key, f"{where}.{key}")
                                    for section, where in patches for key in ("layers", "heads")])
    device = device_for_memory()
    # half-precision weights or mixed precision ("auto" may pick bf16) keep 2-byte activations: the lower bound
    size = 4 if m.dtype in ("auto", "float32") and recipe.train.precision == "fp32" else 2  # auto trains in fp32
    shared = recipe.train.sequence_parallel  # each of N processes holds seq_len / N tokens of a row
    check_fits(config, recipe.data.seq_len * recipe.train.micro_batch_size // shared, training=True, device=device,
               dtype_bytes=size, checkpointing=recipe.train.gradient_checkpointing,
               chunk_tokens=recipe.train.loss_chunk_tokens,
               what=f"training at data.seq_len {recipe.data.seq_len:,} x train.micro_batch_size "
                    f"{recipe.train.micro_batch_size}", lower="data.seq_len or train.micro_batch_size")
    longest = max(recipe.eval.lengths or [recipe.data.seq_len])
    check_fits(config, longest * recipe.eval.batch_size, training=False, device=device, dtype_bytes=size,
               what=f"evaluation at length {longest:,} x eval.batch_size {recipe.eval.batch_size}",
               lower="eval.lengths or eval.batch_size")


def check_selection_counts(config, selections) -> None:
    """(spec, "layers" | "heads", label) selections against the config's layer and head counts, before the weights
    load: an index past them fails in one line (the patch checks the attention modules' own count again)."""
    from ..selection import parse_selection

    counts = {"layers": getattr(config, "num_hidden_layers", None),
              "heads": getattr(config, "num_attention_heads", None)}
    for spec, kind, label in selections:
        if spec is not None and isinstance(counts[kind], int):
            parse_selection(spec, counts[kind], label)


def check_eval_memory(sources, lengths, batch_tokens: int, device=None, dtype=None) -> None:
    """Each model's longest forward (the longest length, windows batched up to batch_tokens) must fit."""
    from ..load import load_config, source_kind
    from ..memory import check_fits

    longest = max(lengths)
    tokens = max(1, batch_tokens // longest) * longest
    for source in sources:
        check_model(source)
        folder = Path(os.path.expanduser(str(source)))
        if source_kind(source) == "gguf" or (folder.is_dir() and not (folder / "config.json").is_file()):
            continue  # a GGUF file, an adapter or a LoRA run: checked when it is loaded
        check_fits(load_config(source), tokens, training=False, device=device or device_for_memory(),
                   dtype_bytes=4 if dtype in (None, "auto", "float32") else 2,  # auto: at most fp32
                   what=f"{source} at length {longest:,}",
                   lower="--lengths or --batch-tokens")
