"""`retrofit <command>`: parse the command line, then call the library.

    retrofit patch gpt2 --norm avnorm --out gpt2-avnorm
    retrofit norms

Each verb is a module retrofit/commands/<verb>.py providing `add_arguments(parser)` and `run(args) -> int`
(a module serving several verbs names them in CLI_COMMANDS = {verb: (add_arguments, run)}). Bad input
raises `RetrofitError`: printed as one line, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import RetrofitError

# command -> (module providing add_arguments/run, one-line help). Modules are imported lazily so that
# `retrofit norms` does not pay for importing the training stack.
COMMANDS = {
    "patch": ("retrofit.commands.patch", "patch a model's attention and save it"),
    "norms": ("retrofit.commands.norms", "list every norm, its options and its formula"),
    "train": ("retrofit.commands.train", "pretrain or finetune from a YAML recipe (accelerate-driven)"),
    "eval": ("retrofit.commands.eval", "length-extrapolation evaluation: loss by length and position"),
    "experiment": ("retrofit.commands.experiment", "pretrain -> finetune arms -> evaluate -> report"),
    "demo": ("retrofit.commands.experiment", "the embedded default experiment: offline, CPU, minutes"),
    "diagnose": ("retrofit.commands.diagnose", "the paper's attention diagnostics on any model"),
    "push": ("retrofit.commands.push", "push a patched checkpoint or run to the Hugging Face Hub"),
    "bench": ("retrofit.commands.bench", "benchmarks: attention kernels, training loop, evaluation"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (so `retrofit norms` starts fast)."""
    parser = _Parser(prog="retrofit", description="Retrofit attention normalizations onto Hugging Face models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != command:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("retrofit"):
                p.set_defaults(_missing=f"`retrofit {name}` is not available in this build")
                continue
            raise
        # a module serving several commands names them in CLI_COMMANDS: {command: (add_arguments, run)}
        add, run = getattr(module, "CLI_COMMANDS", {}).get(name, (module.add_arguments, module.run))
        add(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, rest = parser.parse_known_args(argv)
    # dotted overrides (train.steps=200) may also follow the options: argparse leaves those over
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = list(args.overrides or []) + rest
    elif rest:
        parser.parse_args(argv)  # reports the unrecognized arguments as usual (one line, exit 2)
    if getattr(args, "_missing", None):
        print(f"retrofit: error: {args._missing}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except RetrofitError as err:
        print(f"retrofit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"retrofit {args.command}: error: {err.strerror or err}: {err.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("retrofit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
