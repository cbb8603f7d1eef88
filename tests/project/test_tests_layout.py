"""The tests' own layout (tests/README.md): every test file sits in the folder of the part of retrofit it tests, every
such folder is a package (tests.<folder>.<file> imports) and is named in the README's table, so the grouping stays."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TABLE_ROW = re.compile(r"^\| `tests/([a-z_]+)/` \|", re.M)


def misplaced(tests: Path) -> list[str]:
    """What breaks the layout under `tests`, one line each (empty when it holds)."""
    problems = [f"{p.name} sits at the top of tests/: move it to the folder of what it tests"
                for p in sorted(tests.glob("test_*.py"))]
    folders = {p.parent for p in tests.rglob("test_*.py") if p.parent != tests}
    for folder in sorted(folders):
        where = folder.relative_to(tests)
        problems += [f"{where}/ has no __init__.py"] if not (folder / "__init__.py").exists() else []
        problems += [f"{where}/ is nested: one level of folders"] if folder.parent != tests else []
    named = set(TABLE_ROW.findall((tests / "README.md").read_text()))
    have = {f.name for f in folders if f.parent == tests}
    problems += [f"tests/{name}/ is not in tests/README.md's table" for name in sorted(have - named)]
    problems += [f"tests/README.md names tests/{name}/, which holds no test" for name in sorted(named - have)]
    return problems


def test_every_test_sits_in_a_folder_the_readme_names():
    assert misplaced(TESTS) == []


def test_the_layout_check_catches_what_it_is_for(tmp_path):
    (tmp_path / "README.md").write_text("| `tests/norms/` | x | y |\n| `tests/gone/` | x | y |\n")
    (tmp_path / "test_loose.py").write_text("")
    for folder in ("norms", "extra", "norms/deep"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_x.py").write_text("")
    (tmp_path / "norms" / "__init__.py").write_text("")
    assert misplaced(tmp_path) == [
        "test_loose.py sits at the top of tests/: move it to the folder of what it tests",
        "extra/ has no __init__.py",
        "norms/deep/ has no __init__.py",
        "norms/deep/ is nested: one level of folders",
        "tests/extra/ is not in tests/README.md's table",
        "tests/README.md names tests/gone/, which holds no test",
    ]
