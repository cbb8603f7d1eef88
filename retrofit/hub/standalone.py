"""`retrofit push SRC --standalone`: a checkpoint plain transformers loads with trust_remote_code=True, no retrofit.

    write_standalone(stage, config)   # modeling_retrofit.py beside config.json, and config.json's auto_map

The ecosystem's way to ship a new attention is one modeling file the Hub serves beside the weights
(`AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)`). That file is generated here from retrofit's
own code, never written by hand: remote_code.py (the loader) and every retrofit module it imports (patching, the
norms, the kernels), found by reading their imports, each embedded verbatim except that its package is renamed to a
private one (`retrofit_standalone_<hash of the sources>`: relative imports made absolute, the torch.library
namespace renamed) so it never imports, or collides with, an installed retrofit. The file holds no `import
retrofit`; a reader can check every embedded module against retrofit's sources by the sha256 the header lists.

It is the publisher's explicit choice: a user must still pass trust_remote_code=True to run it, and without it the
guard (record.STANDALONE_GUARD) makes plain transformers refuse the folder by name. retrofit's own loader never runs
it (it reads config.retrofit and refuses remote code), so the same folder loads with retrofit.from_pretrained too.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
from pathlib import Path

from ..errors import RetrofitError
from ..record import STANDALONE_FILE, STANDALONE_GUARD, standalone_auto_map
from ..version import VERSION

FILE = STANDALONE_FILE
RUNTIME = "retrofit.remote_code"  # what the modeling file runs; everything it imports comes along
PREFIX = "retrofit_standalone_"
IMPORT_HEAD = re.compile(r"from\s+[.\w]+\s+import")  # "from ..norms import", the part rename() rewrites
ROOT_INIT = '"""retrofit\'s own code, vendored by `retrofit push --standalone` (see the modeling file\'s header)."""\n'


def module_path(name: str) -> Path | None:
    """The source file of a retrofit module (a package's __init__.py), or None when there is no such module."""
    base = Path(importlib.util.find_spec("retrofit").origin).parent.joinpath(*name.split(".")[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imported(name: str, tree: ast.Module) -> set[str]:
    """The retrofit modules a module imports, at any depth of its code (a function's lazy import counts)."""
    package = name if module_path(name).name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "retrofit":
                continue
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if module_path(f"{target}.{a.name}"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "retrofit")
    return {m for m in found if module_path(m)}


def vendored_modules(start: str = RUNTIME) -> list[str]:
    """`start` and every retrofit module it needs, with their packages; the root package's own imports (the lazy
    public API) are not followed: the export writes its own root (ROOT_INIT)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        if name != "retrofit":
            todo += sorted(_imported(name, ast.parse(module_path(name).read_text())))
    return sorted(seen)


def rename(name: str, source: str, package: str) -> str:
    """`source` of retrofit module `name` with its package called `package`: every import of retrofit (relative or
    absolute) made an absolute import of `package`, and the custom-op namespace `retrofit::` renamed. Nothing else
    changes; the result must parse to the same code but for those names (tests/hub/test_standalone.py)."""
    lines = source.splitlines(keepends=True)
    is_package = module_path(name).name == "__init__.py"
    here = (name if is_package else name.rpartition(".")[0]).split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "retrofit"):
            target = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            line = lines[node.lineno - 1]
            found = IMPORT_HEAD.search(line, node.col_offset)
            lines[node.lineno - 1] = line[:found.start()] + f"from {package}{target[len('retrofit'):]} import" + \
                line[found.end():]
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "retrofit" for a in node.names):
            raise RetrofitError(f"{name} imports retrofit by `import retrofit...` at line {node.lineno}, which a "
                                "standalone export cannot rename; write it as a relative import")
    return "".join(lines).replace('"retrofit::', f'"{package}::')


def sources() -> dict[str, str]:
    """module name -> source as retrofit has it, for every vendored module (the root: ROOT_INIT)."""
    return {name: ROOT_INIT if name == "retrofit" else module_path(name).read_text() for name in vendored_modules()}


def package_name(originals: dict[str, str]) -> str:
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(originals.items())).encode()).hexdigest()
    return f"{PREFIX}{digest[:12]}"


def _literal(text: str) -> str:
    """A raw triple-quoted literal holding `text` exactly, or its repr where a raw literal cannot."""
    literal = f"r'''{text}'''"
    if "'''" not in text and not text.endswith("\\"):
        try:
            if ast.literal_eval(literal) == text:
                return literal
        except (SyntaxError, ValueError):
            pass
    return repr(text)


def modeling_file(architecture: str, norm: str) -> str:
    """The text of modeling_retrofit.py for a checkpoint of transformers class `architecture` patched with `norm`."""
    import transformers

    if not isinstance(getattr(transformers, architecture, None), type):
        raise RetrofitError(f"--standalone needs a model class transformers has; this checkpoint's is {architecture!r}"
                            " (config.json 'architectures'): push it without --standalone")
    originals = sources()
    package = package_name(originals)
    embedded = {name: rename(name, text, package) for name, text in originals.items()}
    listing = "\n".join(f"#   {hashlib.sha256(text.encode()).hexdigest()}  {_relative(name)}"
                        for name, text in originals.items() if name != "retrofit")
    table = "\n".join(f"    {name.partition('.')[2]!r}: {_literal(text)},"
                      for name, text in embedded.items())
    packages = sorted(name.partition(".")[2] for name in originals if module_path(name).name == "__init__.py")
    return TEMPLATE.format(norm=norm, architecture=architecture, version=VERSION, count=len(originals) - 1,
                           package=package, listing=listing, table=table, packages=packages)


def _relative(name: str) -> str:
    path = module_path(name)
    return "/".join(path.parts[len(path.parts) - len(name.split(".")) - (path.name == "__init__.py"):])


def check_standalone(standalone: bool) -> None:
    """An adapter (pushed as one) has no standalone form: said before anything loads."""
    if standalone:
        raise RetrofitError("--standalone exports a whole model, and this is an adapter: add --merged to export the "
                            "merged model, or push the adapter without --standalone")


def write_standalone(stage: Path, info: dict) -> str:
    """Add modeling_retrofit.py to the staged folder and point its config.json at it (auto_map, and the guard that
    says how to load it). info: what publish.stage staged. Returns the class name."""
    check_standalone(info["kind"] != "model")
    if info.get("task"):
        raise RetrofitError("--standalone exports a causal LM, and this model has a task head (task.json) that only "
                            "retrofit loads: push it without --standalone")
    config = json.loads((stage / "config.json").read_text())
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise RetrofitError(f"--standalone needs config.json to name one model class in 'architectures', it has "
                            f"{architectures!r}: save the model with save_pretrained, or push it without --standalone")
    architecture = architectures[0]
    name = f"Retrofit{architecture}"
    (stage / FILE).write_text(modeling_file(architecture, config["retrofit"]["norm"]))
    config["auto_map"] = standalone_auto_map(architecture)
    config["attn_implementation"] = STANDALONE_GUARD
    (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return name


TEMPLATE = '''\
"""{architecture} with retrofit's {norm} attention: load it with transformers alone.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(REPO_OR_FOLDER, trust_remote_code=True)

Written by `retrofit push --standalone` (retrofit {version}). Read it before you trust it: it runs retrofit's own
loading code, {count} modules embedded below, so that no retrofit install is needed. Each is retrofit {version}'s
file as it is, but for its package name ({package}: relative imports made absolute, the torch.library
namespace renamed), so it never imports or collides with an installed retrofit. The class below is the model
class transformers has, with the patch recorded in config.json's `retrofit` section rebuilt on load: the base
weights, then the norm, then its tensors, each checked (remote_code.py). With retrofit installed,
retrofit.from_pretrained loads this folder without running this file. Below: the importer of the embedded modules,
the modules (SOURCES), and at the end the model class.
"""

# sha256 of each embedded module's original text (retrofit {version}'s sources):
{listing}

import importlib
import importlib.abc
import importlib.util
import linecache
import sys

from transformers import {architecture}

PACKAGE = "{package}"


class _Embedded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports PACKAGE's modules from SOURCES (tracebacks show their lines)."""

    package = PACKAGE

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        key = fullname[len(PACKAGE) + 1:]
        if key not in SOURCES:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=key in PACKAGES)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        source = SOURCES[module.__name__[len(PACKAGE) + 1:]]
        filename = "<" + module.__name__.replace(".", "/") + ".py>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), module.__dict__)


PACKAGES = {packages!r}  # the embedded modules that are packages
SOURCES = {{  # module under PACKAGE -> its source
{table}
}}


if not any(getattr(f, "package", None) == PACKAGE for f in sys.meta_path):  # once, however often this file runs
    sys.meta_path.append(_Embedded())
StandaloneModel = importlib.import_module(PACKAGE + ".remote_code").StandaloneModel


class Retrofit{architecture}(StandaloneModel, {architecture}):
    """{architecture} with the patch recorded in config.retrofit ({norm}), rebuilt when it loads."""
'''


__all__ = ["FILE", "check_standalone", "modeling_file", "rename", "sources", "vendored_modules", "write_standalone"]
