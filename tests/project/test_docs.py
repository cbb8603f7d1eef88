"""The README is a front door and the documentation site's facts stay true, checked without mkdocs (CI builds the
site itself with `mkdocs build --strict`, which fails on a broken link inside docs/): the README's length, its two
commands, its links, the results it quotes, and the architecture page's layer table against
tests/project/test_layout.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.project.test_layout import RANKS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadscope"  # pytest-xdist: two worker processes (tests/conftest.py)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# one quoted number: a signed decimal, with its ± half-width when it has one ("-0.791 ± 0.191", "−0.796", "6,271")
NUMBER = re.compile(r"[−+-]?\d[\d,]*\.\d+(?: ± \d+\.\d+)?")


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if "://" not in t and not t.startswith("mailto:")]


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, "README.md is a front door: move the detail to a page under docs/"
    assert "pip install torch==2.13.0 && pip install -e . && retrofit demo\n" in text
    # setuptools and wheel: deepspeed's build without isolation needs them, which a fresh venv of Python >= 3.12 lacks
    install = "pip install torch==2.13.0 setuptools wheel && pip install --no-build-isolation deepspeed==0.19.8 && "
    assert f'{install}pip install -e ".[test]" && {TEST_COMMAND}\n' in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{TEST_COMMAND}\n" in ci  # CI runs exactly the README's command, after the same installs
    assert "pip install --quiet --no-build-isolation deepspeed==0.19.8\n" in ci and '"deepspeed==0.19.8"' in (
        ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def _results_rows(page: Path) -> list[tuple[str, str, list[Path]]]:
    """(claim, difference cell, linked result files) for every row of the page's results table."""
    text = page.read_text()
    rows = []
    for line in text[text.index("| claim |"):].splitlines()[2:]:  # after the header and its rule
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        targets = [page.parent / t for t in LINK.findall(cells[-1])]
        if targets:
            rows.append((cells[0], cells[2], targets))
    return rows


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "results.md"], ids=lambda p: p.name)
def test_quoted_results_are_in_the_linked_result_as_written(page):
    """Every number a results table quotes appears, character for character, in a markdown file of the result it
    links (the result's folder and below): a number re-typed, rounded again or given another minus sign fails."""
    rows = _results_rows(page)
    assert len(rows) >= 8, f"{page.name}: the results table was not found"
    for claim, cell, targets in rows:
        quoted = "".join(f.read_text() for t in targets for f in sorted(t.parent.rglob("*.md")))
        missing = [n for n in NUMBER.findall(cell) if n not in quoted]
        assert not missing, f"{page.name}, {claim!r}: {missing} not in {[str(t) for t in targets]}"


def test_the_architecture_page_shows_the_enforced_ranks():
    """docs/architecture.md's layer table is tests/project/test_layout.py's RANKS, so the documented data flow is the
    one the imports are held to."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    documented = {}
    for rank, modules in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M):
        for name in re.findall(r"`([\w.]+)`", modules):
            documented[name] = int(rank)
        if "the package root" in modules:
            documented[""] = int(rank)
    assert documented == RANKS
