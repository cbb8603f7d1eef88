"""A verb module stays thin (docs/architecture.md: parse -> call the library -> print), read from the source with `ast`.

Two rules hold for every `retrofit/commands/<verb>.py` (not `__init__.py`, the flag checks every verb shares, nor
`patch_flags.py`, the flag table):

1. **A command writes nothing itself.** It imports none of the writers and locks (atomic writes, output folders, the
   folder lock, markers, fsync) and calls no `open`, `write_text`, `json.dump`, `mkdir`, `unlink`, `rmtree`: what is
   written, and when a folder is locked, is the library's, so a Python caller gets the same files and the same
   refusals. `retrofit report` once rewrote folders under their locks in the command; `retrofit eval` once made --out
   and wrote the report there: both would fail this rule.
2. **A loop in a command only prints or checks its flags.** Each statement in a `for`/`while` body is a `print(...)`,
   a `check_*(...)` call or a loop of the same kind: a command may print the rows the library returned and check each
   of its own flags, but a loop over folders to rewrite or models to score is library logic (comprehensions, which
   build arguments, are not statements and are allowed).

`bench` passes its flags on to the benchmark module it names (retrofit/bench/: each one's own add_arguments and
run(args)); it writes nothing itself either, so both rules hold for it as written.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMMANDS = Path(__file__).resolve().parents[2] / "retrofit" / "commands"
NOT_VERBS = {"__init__.py", "patch_flags.py"}
VERBS = sorted(p for p in COMMANDS.glob("*.py") if p.name not in NOT_VERBS)
# retrofit.atomic's and retrofit.fs's names that write, remove or lock (the checks, check_output and output_path, are
# a command's to call: they write nothing)
WRITERS = {"atomic_write_text", "atomic_writer", "atomic_folder", "output_folder", "make_output", "folder_lock",
           "write_marker", "remove_owned", "clean_abandoned", "fsync_dir", "fsync_tree"}
WRITING_CALLS = {"open", "write_text", "write_bytes", "mkdir", "makedirs", "unlink", "rmtree", "rename", "dump",
                 "safe_dump", "save_pretrained"}


def _called(node: ast.Call) -> str:
    """The last name of what a call calls: print for print(...), write_text for path.write_text(...)."""
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def writes(source: str, where: str) -> list[str]:
    """'where:line ...' for every writer imported and every writing call in one verb module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if a.name in WRITERS]
        elif isinstance(node, ast.Call) and _called(node) in WRITING_CALLS:
            found.append(f"{where}:{node.lineno} calls {_called(node)}")
    return found


def _prints_or_checks(statement: ast.stmt) -> bool:
    if isinstance(statement, (ast.For, ast.While)):
        return all(_prints_or_checks(s) for s in statement.body + statement.orelse)
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and (_called(statement.value) == "print" or _called(statement.value).startswith("check")))


def working_loops(source: str, where: str) -> list[str]:
    """'where:line' for every loop in one verb module whose body does more than print and check flags."""
    return [f"{where}:{node.lineno} loops over more than printing and checking" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.For, ast.While)) and not _prints_or_checks(node)]


def test_there_are_verbs_to_check():
    assert {"patch.py", "eval.py", "report.py", "train.py", "bench.py"} <= {p.name for p in VERBS}


@pytest.mark.parametrize("path", VERBS, ids=lambda p: p.name)
def test_a_command_writes_nothing_itself(path):
    assert writes(path.read_text(), f"commands/{path.name}") == []


@pytest.mark.parametrize("path", VERBS, ids=lambda p: p.name)
def test_a_loop_in_a_command_only_prints_or_checks(path):
    assert working_loops(path.read_text(), f"commands/{path.name}") == []


def test_the_rules_catch_what_they_are_for():
    """The old `retrofit report` (folders locked and rewritten in a loop) and a command that writes its own file are
    reported; printing rows and checking flags in a loop are not."""
    old_report = ("from ..atomic import folder_lock\n"
                  "def run(args):\n"
                  "    for path, results in loaded:\n"
                  "        locks.enter_context(folder_lock(path.parent))\n"
                  "    for path, results in loaded:\n"
                  "        write_report(rejudge(results), path.parent)\n"
                  "        print(f'report: {path.parent} judged again')\n")
    assert writes(old_report, "r.py") == ["r.py:1 imports folder_lock"]
    assert working_loops(old_report, "r.py") == ["r.py:3 loops over more than printing and checking",
                                                 "r.py:5 loops over more than printing and checking"]
    own_file = "def run(args):\n    Path(args.out).write_text(text)\n    json.dump(results, open(args.out, 'w'))\n"
    assert writes(own_file, "w.py") == ["w.py:2 calls write_text", "w.py:3 calls dump", "w.py:3 calls open"]
    fine = ("def run(args):\n"
            "    for name in ('samples', 'trials'):\n        check_size(getattr(args, name), name, 10)\n"
            "    for row in rows:\n        print(row)\n        for opt in row:\n            print(opt)\n")
    assert writes(fine, "f.py") == [] and working_loops(fine, "f.py") == []
