"""`retrofit <command>`: parse the command line, then call the library.

    retrofit patch gpt2 --norm avnorm --out gpt2-avnorm
    retrofit norms

Each verb is a module retrofit/commands/<verb>.py providing `add_arguments(parser)` and `run(args) -> int`
(a module serving several verbs names them in CLI_COMMANDS = {verb: (add_arguments, run)}). Bad input
raises `RetrofitError`: printed as one line, exit code 2, no traceback. So do the errors of the machine and
of damaged files (one_line_error): permissions, a full disk, a truncated safetensors file, text that is not
UTF-8, a damaged JSON file, memory that cannot be allocated. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import sys

from .errors import RetrofitError, one_line, write_failure
from .notices import quiet_deepspeed_cpu_notice
from .version import DISTRIBUTION, FOREIGN_MARKER, INSTALL, VERSION

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
    "tokenizer": ("retrofit.commands.tokenizer", "train a small byte-level BPE tokenizer on text files"),
    "report": ("retrofit.commands.report", "judge finished results again: intervals, paired differences"),
    "adopt": ("retrofit.commands.adopt", "mark a folder an older retrofit wrote as retrofit's (listing it first)"),
    "info": ("retrofit.commands.info", "what a folder, run, adapter or Hub id is: base, norm, options, rope, trained"),
}


# errno -> what to do about it (the message itself is the system's: "Permission denied: 'x'")
WHAT_TO_DO = {
    errno.EACCES: "check its permissions, or choose another path",
    errno.EPERM: "check its permissions, or choose another path",
    errno.EISDIR: "give a file there, not a folder",
    errno.ENOTDIR: "a part of that path is a file, not a folder",
    errno.ENOSPC: "the disk is full: free some space or choose another --out",
    errno.EDQUOT: "the disk quota is used up: free some space or choose another --out",
    errno.EROFS: "that file system is read-only: choose another --out",
    errno.EFBIG: "a file reached the size limit: raise `ulimit -f`, or choose another --out",
    errno.ENOENT: "check the path",
    errno.EEXIST: "choose another path or remove it",
}
# what PyTorch's allocators say when they cannot allocate (CPU: DefaultCPUAllocator; CUDA: OutOfMemoryError)
ALLOCATION = re.compile(r"can't allocate|could not allocate|cannot allocate|out of memory|not enough memory", re.I)


def one_line_error(err: BaseException) -> str | None:
    """The one line for an error of the machine or of a damaged file (not of retrofit's code); None for a bug."""
    name = type(err).__name__
    if isinstance(err, MemoryError) or name == "OutOfMemoryError" or (
            isinstance(err, RuntimeError) and ALLOCATION.search(str(err))):
        first = (str(err).strip().splitlines() or [name])[0][:200]
        return (f"out of memory ({first}); lower the length or batch (--lengths, --batch-tokens, data.seq_len, "
                "train.micro_batch_size) or use a machine with more memory")
    failed = None if isinstance(err, OSError) else write_failure(err)  # an OSError says it itself (below)
    if failed is not None:  # before the readers' words: a writer that ran out of room is not a damaged file
        first = (str(err).strip().splitlines() or [name])[0][:160]
        return (f"a write failed: {failed} ({first}); make room (free space, raise `ulimit -f`) or choose "
                "another --out")
    if name == "SafetensorError":
        return f"a .safetensors file is damaged ({str(err).strip()[:160]}); re-download or re-save the model"
    if isinstance(err, UnicodeDecodeError):
        return (f"a file is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); convert it to UTF-8, "
                "e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8")
    if isinstance(err, json.JSONDecodeError):
        return (f"a JSON file is damaged ({err.msg}, line {err.lineno} column {err.colno}); restore or re-create it "
                "(a run's result.json is rewritten by resuming the run)")
    if isinstance(err, OSError):
        what = err.strerror or (str(err).strip().splitlines() or [name])[0][:200]
        where = f": {err.filename}" if err.filename else ""
        todo = WHAT_TO_DO.get(err.errno)
        return f"{what}{where}" + (f"; {todo}" if todo else "")
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (so `retrofit --help` starts fast). The verbs'
    parsers are in `parser.verbs` (an argument error is reported by the verb's own parser, naming it)."""
    parser = _Parser(prog="retrofit", description="Retrofit attention normalizations onto Hugging Face models.",
                     epilog=f"examples:\n{EXAMPLES}\n\n`retrofit COMMAND --help` for a command's options and "
                            f"examples.\nInstall: {INSTALL}",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"retrofit {VERSION} ({DISTRIBUTION})")
    # `deepspeed --module retrofit train ...` starts `python -m retrofit --local_rank=N train ...` (unless
    # --no_local_rank); the rank is in LOCAL_RANK too, which is what accelerate reads: taken, not used
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    parser.verbs = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = parser.verbs[name] = sub.add_parser(name, help=help_text, description=help_text,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        if name != command:
            continue
        module = importlib.import_module(module_name)  # every verb's module ships (test_bench imports each)
        # a module serving several commands names them in CLI_COMMANDS: {command: (add_arguments, run)}
        add, run = getattr(module, "CLI_COMMANDS", {}).get(name, (module.add_arguments, module.run))
        add(p)
        p.epilog = "\n\n".join(filter(None, [examples(module.__doc__, name), p.epilog]))
        p.set_defaults(_run=run)
    return parser


EXAMPLES = """\
  retrofit patch ./smollm2.gguf --norm avnorm --calibration-text book.txt --out smol-avnorm
  retrofit train recipes/train-tiny-counting.yaml train.steps=200
  retrofit eval smol-avnorm --data book.txt --lengths 512,1024,...,8192 --out eval/
  retrofit demo                                   # offline, on the CPU, a few minutes
  retrofit info smol-avnorm"""


def examples(doc: str | None, command: str) -> str:
    """The usage lines a verb's module docstring shows for `command` (indented `retrofit COMMAND ...` lines, with
    the lines a trailing backslash continues), as the verb's --help epilog; '' when it has none."""
    lines, keep = [], False
    for line in (doc or "").splitlines():
        if line.startswith("    ") and (keep or re.search(rf"(^|\s)retrofit {command}(\s|$)", line)):
            lines.append("  " + line.strip())
            keep = line.rstrip().endswith("\\")
        else:
            keep = False
    return "examples:\n" + "\n".join(lines) if lines else ""


def foreign_package() -> str | None:
    """The one line saying that PyPI's unrelated `retrofit` distribution shares this folder (its wheel installs a
    top-level `retrofit` too, and one overwrote the other's files), else None. One stat: cheap enough for every run."""
    if os.path.exists(os.path.join(os.path.dirname(__file__), FOREIGN_MARKER)):
        return (f"the `retrofit` folder {os.path.dirname(__file__)} also holds files of PyPI's unrelated `retrofit` "
                f"distribution; run `pip uninstall -y retrofit {DISTRIBUTION} && {INSTALL}`")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_deepspeed_cpu_notice()  # `import retrofit` did already (idempotent): the CLI says so itself
    foreign = foreign_package()
    if foreign:
        print(f"retrofit: error: {foreign}", file=sys.stderr)
        return 2
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, rest = parser.parse_known_args(argv)
    # dotted overrides (train.steps=200) may also follow the options: argparse leaves those over
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = list(args.overrides or []) + rest
    elif rest:  # the verb's own parser reports them: `retrofit eval: error: unrecognized arguments: --x`
        parser.verbs[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args._run(args) or 0)
    except RetrofitError as err:
        print(f"retrofit {args.command}: error: {err}", file=sys.stderr)  # one line (its control characters escaped)
        return 2
    except KeyboardInterrupt:
        print("retrofit: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        line = one_line_error(err)
        if line is None:
            raise  # a bug in retrofit: keep the traceback
        print(f"retrofit {args.command}: error: {one_line(line)}", file=sys.stderr)  # a file name may hold a newline
        return 2


if __name__ == "__main__":
    sys.exit(main())
