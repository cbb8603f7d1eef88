"""The README is a front door and the documentation site's facts stay true, checked without mkdocs (CI builds the
site itself with `mkdocs build --strict`, which fails on a broken link inside docs/): the README's length, its two
commands, its links, the results it quotes, and the architecture page: its tree against the files under retrofit/,
its layer table against tests/project/test_layout.py, every `file.py:name` it draws against the code."""

from __future__ import annotations

import ast
import importlib.util
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


def _architecture() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def _section(text: str, heading: str) -> str:
    """The text under `heading` (a markdown heading line), up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    assert f"\n{heading}\n" in text, f"docs/architecture.md has no section {heading!r}"
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), text[start:], re.M)]
    return text[start:start + ends[0]] if ends else text[start:]


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```\n(.*?)^```$", text, re.M | re.S)


TREE_LINE = re.compile(r"^(?P<indent>(?:  )+)(?P<name>\w+(?:\.py|/))(?: {2,}(?P<what>\S.*))?$")


def _tree() -> list[tuple[str, str]]:
    """(path under retrofit/, what it holds) for every line of the Layout tree: `retrofit/`, then one entry a line,
    indented two spaces a level under its folder (`name/`), the name followed by two or more spaces and one line on
    what it holds. A line of any other shape fails: the tree is a format, not prose."""
    lines = _code_blocks(_section(_architecture(), "## Layout"))[0].splitlines()
    assert lines[0] == "retrofit/", "the Layout tree starts with the line `retrofit/`"
    entries, folders = [], []  # folders: the open folder at each depth
    for line in lines[1:]:
        match = TREE_LINE.match(line)
        assert match, f"Layout tree: {line!r} is not `  name.py  what it holds` (or `name/`), indented by level"
        depth, name = len(match["indent"]) // 2, match["name"]
        assert depth <= len(folders) + 1, f"Layout tree: {name} is indented under no folder"
        assert match["what"], f"Layout tree: {name} says nothing about what it holds"
        folders = folders[:depth - 1]
        entries.append(("".join(folders) + name, match["what"]))
        if name.endswith("/"):
            folders.append(name)
    return entries


def test_the_architecture_tree_names_every_package_file_and_no_other():
    """docs/architecture.md's Layout tree has one line for every .py file under retrofit/ (a new module is
    described there when it is added) and names no file or folder that does not exist (a rename carries the tree
    with it)."""
    entries = _tree()
    listed = [path for path, _ in entries if path.endswith(".py")]
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({p for p in listed if listed.count(p) > 1})}"
    package = ROOT / "retrofit"
    present = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    unlisted, absent = sorted(present - set(listed)), sorted(set(listed) - present)
    assert not unlisted, f"files under retrofit/ missing from the Layout tree: {unlisted}"
    assert not absent, f"the Layout tree names files that do not exist: {absent}"
    folders = [path for path, _ in entries if path.endswith("/")]
    assert all((package / f).is_dir() for f in folders), [f for f in folders if not (package / f).is_dir()]


def test_the_architecture_tree_goes_bottom_up_by_rank():
    """The tree's top-level entries come in the order of their ranks (tests/project/test_layout.py), as the page
    says: each one's rank is at least the rank of the entry above it."""
    tops = [path.removesuffix("/").removesuffix(".py") for path, _ in _tree() if "/" not in path.removesuffix("/")]
    ranks = [RANKS["" if top == "__init__" else top] for top in tops]
    out_of_order = [f"{a} ({ra}) before {b} ({rb})"
                    for a, b, ra, rb in zip(tops, tops[1:], ranks, ranks[1:]) if rb < ra]
    assert not out_of_order, f"Layout tree out of rank order: {out_of_order}"


def test_the_architecture_page_shows_the_enforced_ranks():
    """docs/architecture.md's layer table is tests/project/test_layout.py's RANKS: every rank has its row, every
    module sits in the row of its rank and in no other, so the documented data flow is the one the imports are held
    to."""
    text = _architecture()
    placed = []  # (module, rank) for every module a row names
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M)
    for rank, modules in rows:
        placed += [(name, int(rank)) for name in re.findall(r"`([\w.]+)`", modules)]
        if "the package root" in modules:
            placed.append(("", int(rank)))
    assert [int(rank) for rank, _ in rows] == sorted(set(RANKS.values())), "one row per rank, bottom up"
    names = [name for name, _ in placed]
    assert len(names) == len(set(names)), f"in two rows: {sorted({n for n in names if names.count(n) > 1})}"
    misplaced = {name: (rank, RANKS.get(name)) for name, rank in placed if RANKS.get(name) != rank}
    assert not misplaced, f"module: (row, rank in RANKS): {misplaced}"
    assert set(names) == set(RANKS), f"missing from the table: {sorted(set(RANKS) - set(names))}"


# `file.py:name` in the page: a definition `name` (or `Class.method`) in retrofit/file.py, or in the installed
# transformers for `transformers/...`; a bare `dir/file.py` outside the Layout tree: a file there or in the repository.
DEFINITION = re.compile(r"(?<![\w/.<>-])((?:\w+/)*\w+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
FILE = re.compile(r"(?<![\w/.<>-])((?:\w+/)*\w+\.py)(?![\w/])")
TRANSFORMERS = Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
# What each run-time diagram must show at least: the seam from the registry to the op, the mask from the resets
# to the keys a query sees.
DIAGRAMS = {
    "### The attention seam: from a model's forward to a kernel": [
        "transformers/modeling_utils.py:ALL_ATTENTION_FUNCTIONS", "attention_seam.py:retrofit_attention",
        "attention_seam.py:retrofit_eager_attention", "attention_seam.py:_dispatch",
        "norms/attention_call.py:kernel_call",
        "norms/attention_call.py:visible_keys", "kernels/dispatch.py:choose", "kernels/custom_ops.py:attention_op",
        "norms/output_hook.py:ProjectionHook", "norms/avnorm.py:AVNorm.forward"],
    "### The packing path: from packed documents to the keys a query sees": [
        "data/packing.py:packed_batch", "transformers/masking_utils.py:create_causal_mask",
        "transformers/masking_utils.py:find_packed_sequence_indices", "attention_seam.py:IMPLEMENTATIONS",
        "transformers/masking_utils.py:AttentionMaskInterface", "norms/attention_call.py:visible_keys",
        "train/run_checks.py:PACKED_MASKS"],
}


def _file_of(token: str) -> Path:
    if token.startswith("transformers/"):
        return TRANSFORMERS / token.removeprefix("transformers/")
    found = [base / token for base in (ROOT / "retrofit", ROOT) if (base / token).is_file()]
    return found[0] if found else ROOT / "retrofit" / token


def _defines(body: list[ast.stmt], name: str) -> list[ast.stmt] | None:
    """The body of `name`'s definition among `body` (a def, a class or an assignment; [] for a name without a
    body), or None when `body` does not define it. An import is not a definition."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node.body
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            if name in [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]:
                return []
    return None


def _resolves(path: str, name: str) -> bool:
    file = _file_of(path)
    if not file.is_file():
        return False
    body = ast.parse(file.read_text()).body
    for part in name.split("."):
        body = _defines(body, part) if body is not None else None
    return body is not None


def test_every_name_the_architecture_page_draws_is_in_the_code():
    """Every `file.py:name` on docs/architecture.md — the two run-time diagrams above all — is a definition in that
    file (read by ast, nothing imported), and every file the page names outside its tree exists: a rename or a move
    that leaves the page behind fails here."""
    text = _architecture()
    missing = sorted({f"{p}:{n}" for p, n in DEFINITION.findall(text) if not _resolves(p, n)})
    assert not missing, f"docs/architecture.md names definitions the code does not have: {missing}"
    outside_tree = text.replace(_code_blocks(_section(text, "## Layout"))[0], "")
    files = sorted({p for p in FILE.findall(outside_tree) if not _file_of(p).is_file()})
    assert not files, f"docs/architecture.md names files that do not exist: {files}"


@pytest.mark.parametrize("heading", DIAGRAMS, ids=["attention seam", "packing path"])
def test_the_run_time_diagrams_show_the_path(heading):
    """The page draws the two paths no import reveals, each as a diagram naming the real functions along it: the
    attention seam (transformers' registry -> retrofit's attention function -> the norm -> the kernels' op) and the
    packing path (position_ids -> create_causal_mask -> the mask function registered under retrofit's name -> the
    keys a query sees)."""
    diagram = "".join(_code_blocks(_section(_architecture(), heading)))
    drawn = {f"{p}:{n}" for p, n in DEFINITION.findall(diagram)}
    assert not set(DIAGRAMS[heading]) - drawn, f"{heading}: not drawn: {sorted(set(DIAGRAMS[heading]) - drawn)}"


def test_the_checkpoint_loaders_note_names_its_callers_outside_load():
    """load/patched_checkpoint.py says who imports it from outside load/ (issue 63: its note had gone false): every
    such module is named in its docstring, and every module named there imports it."""
    path = ROOT / "retrofit/load/patched_checkpoint.py"
    note = ast.get_docstring(ast.parse(path.read_text()))
    importers = set()
    for module in (ROOT / "retrofit").rglob("*.py"):
        if module.parent.name == "load" and module.parent.parent.name == "retrofit":
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("load.patched_checkpoint"):
                importers.add(module.relative_to(ROOT / "retrofit").as_posix())
    named = set(re.findall(r"\b(\w+/\w+\.py)\b", note)) - {"load/adapters.py"}
    assert importers == named, (importers, named)
