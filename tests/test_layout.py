"""The package's shape: no import cycle, imports only point down the data flow, no private name crosses a
module, no module over 400 lines. Read from the source with `ast` (in-function imports count), so it fails
on the commit that breaks the shape, not when someone notices."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "retrofit"

# The data flow, bottom up: recipe -> load -> patch -> train -> evaluate -> report -> push. A module may
# import its own package and anything of a strictly lower rank; siblings of one rank never import each other
# (evaluate must not need train to load a run, and norms/kernels import nothing above them).
RANKS = {
    "errors": 0, "version": 0, "atomic": 1, "memory": 1, "lengths": 1, "logit_head": 1, "record": 1,
    "kernels": 2, "families": 2,
    "positions": 3,
    "rope": 4, "norms": 4,
    "patch": 5,
    "calibrate": 6, "recipe": 6, "recovery": 6,
    "load": 7,
    "data": 8,
    "train": 9, "evaluate": 9, "diagnose": 9,
    "experiment": 10, "hub": 10, "bench": 10,
    "commands": 11,
    "cli": 12,
    "__main__": 13, "": 13,  # "" = the package root, retrofit/__init__.py: the public API, imported by nobody inside
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(["retrofit", *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path):
    """(line, imported module, imported names) for every import of a retrofit module in `name`."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "retrofit":
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            if target.split(".")[0] != "retrofit":
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                child = f"{target}.{alias.name}"
                yield node.lineno, child if child in MODULES else target, [] if child in MODULES else [alias.name]


def _owner(module: str) -> str:
    """The existing module an import resolves to (retrofit.load.runs.load -> retrofit.load.runs)."""
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for _, target, _ in _imports(name, path):
            target = _owner(target)
            if target != name and not name.startswith(target + "."):  # a module importing its own package
                graph[name].add(target)
    return graph


def test_every_top_level_module_has_a_rank():
    assert {_top(m) for m in MODULES} <= set(RANKS), sorted({_top(m) for m in MODULES} - set(RANKS))


def test_no_import_cycle():
    graph, index, low, stack, on, cycles, counter = _graph(), {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_imports_point_down_the_data_flow():
    upward = []
    for name, path in MODULES.items():
        for line, target, _ in _imports(name, path):
            here, there = _top(name), _top(_owner(target))
            if here != there and not RANKS[there] < RANKS[here]:
                upward.append(f"{_where(path)}:{line} imports {target}")
    assert upward == []


def test_no_private_name_crosses_a_module():
    crossing = []
    for name, path in MODULES.items():
        for line, target, names in _imports(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and _owner(target) != name:
                crossing.append(f"{_where(path)}:{line} imports {private} from {target}")
    assert crossing == []


def test_no_module_over_400_lines():
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in MODULES.values()}
    assert {k: v for k, v in sizes.items() if v > 400} == {}


@pytest.mark.parametrize("bad, message", [
    ("from ..train import train\n", "imports retrofit.train"),
    ("from .patch import _private\n", "imports ['_private']"),
])
def test_the_checks_catch_what_they_are_for(bad, message, tmp_path, monkeypatch):
    """A planted upward import in evaluate and a private import are reported (the checks are not vacuous)."""
    planted = tmp_path / "planted.py"
    planted.write_text(bad)
    name = "retrofit.evaluate.planted" if bad.startswith("from ..") else "retrofit.planted"
    monkeypatch.setitem(MODULES, name, planted)
    monkeypatch.setitem(RANKS, "planted", 9)
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        if "train" in bad:
            test_imports_point_down_the_data_flow()
        else:
            test_no_private_name_crosses_a_module()
