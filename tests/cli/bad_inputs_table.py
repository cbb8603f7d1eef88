"""Print the bad-input table from tests/cli/test_bad_inputs.py's CASES: input -> exit code -> first line printed ->
peak MB (the resident set's high-water mark the case added, retrofit.memory.PeakMemory).

    OMP_NUM_THREADS=1 python tests/cli/bad_inputs_table.py > bad-inputs.md

Each case runs in-process through `retrofit.cli.main` against a fresh temporary world (W = its folder).
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from retrofit.cli import main  # noqa: E402
from retrofit.errors import one_line  # noqa: E402
from retrofit.memory import PeakMemory  # noqa: E402
from tests.cli.test_bad_inputs import CASES, argv, build_world  # noqa: E402


def run_case(template: str, world: dict, out: Path) -> tuple[int, str, float]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), PeakMemory("cpu") as memory:
        try:
            code = main(argv(template, world, out))
        except SystemExit as exit_:
            code = exit_.code
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return code, lines[0] if lines else "", memory.added_mb


def main_table() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        world = build_world(Path(tmp) / "W")
        print("| case | input | exit | first line printed | peak MB added |\n|---|---|---|---|---|")
        for i, (case_id, template, _) in enumerate(CASES):
            code, line, added_mb = run_case(template, world, Path(tmp) / f"out{i}")
            shown = one_line(shlex.join(template) if isinstance(template, list) else template).replace(
                "{{", "{").replace("}}", "}")
            line = line.replace(str(Path(tmp) / f"out{i}"), "OUT").replace(world["root"], "W")
            print(f"| {case_id} | `{shown}` | {code} | {line.replace('|', '/')} | {added_mb:.0f} |")


if __name__ == "__main__":
    main_table()
