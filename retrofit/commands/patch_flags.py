"""`retrofit patch`'s norm flags, built when the parser is built from each norm's declared options; and the one
command that rewrites every copy of what the registry declares.

The registry's options (each norm's option schema: Norm.option_schema, its fields' names, types and docs) are
written out below as OPTIONS, because reading them from the registry imports every norm, and so torch: `retrofit
patch --help` takes 0.05 s with the table and 2.7 s through the registry (the import alone), and an argument error as
long. The table is the registry's, field by field, and nothing else: each norm is named once, as the key of its
options. norm -> {option: (type: "str" | "int" | "float", a union "float|str", or None = a switch; its doc)}.

    python -m retrofit.commands.patch_flags     # rewrites every derived copy that is stale, and says which

The copies (derived_copies): OPTIONS here, the recipe reference page docs/reference/recipe.md (what `retrofit train
--keys --markdown` prints, the norms' options among its keys), the norms' lines of docs/architecture.md's tree
(each norm's file and summary), the norms' tables of docs/patching.md and README.md, and the line of
norms/__init__.py that imports every norm file (found by its `@register_norm`, so a new norm's file is registered by
this command, not by hand). tests/cli/test_cli_habits.py fails while any of them is stale.
"""

import re
from pathlib import Path

OPTIONS = {'avnorm': {'kind': ('str', 'rms | layer | global'),
            'affine': (None, 'add a learned per-channel weight (and bias for layer/global)'),
            'eps': ('float', 'added to the variance before the square root'),
            'gain': ('float', 'initial per-head gain; retrofit.calibrate() overwrites it'),
            'floor': ('float',
                      'kind=rms: per-head floor eps = floor * gain under the RMS; 0 = AVNorm, large (inf) = the '
                      'original model; recovery.schedule anneals it to 0'),
            'mode': ('str',
                     "always (normalize every token) | beyond (the original model inside L; beyond it each head's "
                     'output times (n / L)^b_h, b_h calibrated and trainable)'),
            'exponent': ('float',
                         'mode=beyond: initial b_h (0 = the original model everywhere); retrofit.calibrate() fits it '
                         'per head'),
            'ref_len': ('int', "mode=beyond: L; default the model's original max positions (before rope=)")},
 'psoftmax': {'p': ('float', "the norm's order, >= 1 (1 = softmax, 2 = L2 softmax)"),
              'gain': ('float',
                       'initial per-head output gain (learned); retrofit.calibrate() sets it from text; null = no '
                       'gain')},
 'sigmoid': {'bias': ('float', 'the logit bias b; null = -log n, n the keys the query sees')},
 'softmax': {},
 'softmax1': {'learnable': (None, 'learn a per-head sink logit b_h (init `sink`) instead of a fixed one'),
              'sink': ('float',
                       'the sink logit b_h (learnable: its initial value); very negative = the original softmax, 0 = '
                       'softmax+1'),
              'stack': (None, 'allow on models with learned sinks of their own (gpt_oss): both sinks count')},
 'ssmax': {'scale': ('str', 'learned (s_h*log n) | beyond (max(1, log n/log L)) | llama4 (floored)'),
           's_init': ('float', 'learned: initial s; default 1/log(ref_len) (factor exactly 1 there)'),
           'ref_len': ('int', "L: default the model's original max positions (before rope=)"),
           'beta': ('float', "llama4: strength; default 0.1 (Llama 4's attn_scale)"),
           'stack': (None, 'allow on models that already scale queries by position (Llama 4)'),
           'blend': ('float', 'alpha in factor 1 + alpha * (f(n) - 1): 0 = the original model, 1 = SSMax')}}

TYPES = {"str": str, "int": int, "float": float}


def flag_type(kind: str | None):
    """The argparse type of a flag OPTIONS writes as `kind`: None = a switch; "float|str" (a union, from the hint)
    tries each number kind in turn and takes the text as it is if str is among them."""
    if kind is None or kind in TYPES:
        return TYPES.get(kind) if kind else None
    kinds = kind.split("|")

    def convert(text: str):
        for number in (k for k in kinds if k != "str"):
            try:
                return TYPES[number](text)
            except ValueError:
                pass
        if "str" in kinds:
            return text
        raise ValueError(text)

    convert.__name__ = kind  # argparse's error: "invalid float|str value"
    return convert


def declared_options() -> dict[str, dict[str, tuple]]:
    """Every registered norm's options as OPTIONS writes them, read from the registry's schema (imports every norm,
    and so torch): norm -> {option: (flag type, None for a bool switch; doc)}, in the order its Options declares."""
    from ..norms import NORMS

    return {name: {o.name: (o.flag_type, o.doc) for o in cls.option_schema()} for name, cls in sorted(NORMS.items())}


def norm_flags(options: dict[str, dict[str, tuple]] = OPTIONS) -> dict[str, dict]:
    """One flag per option any norm declares: option -> {type (None = a switch), norms (that declare it), doc (each
    norm's, prefixed by the norms that share it)}. Only flags the user set are passed on, so an option the chosen
    norm lacks is the PatchSpec's error naming that norm's options."""
    flags: dict[str, dict] = {}
    for norm, declared in sorted(options.items()):
        for option, (kind, doc) in declared.items():
            kinds = frozenset(kind.split("|")) if kind else None
            flag = flags.setdefault(option, {"type": flag_type(kind), "kinds": kinds, "norms": [], "docs": {}})
            if flag["kinds"] != kinds:
                raise ValueError(f"norms {flag['norms'][0]!r} and {norm!r} declare option {option!r} with different "
                                 "types; one flag takes one type: give one of them another name")
            flag["norms"].append(norm)
            flag["docs"].setdefault(doc, []).append(norm)
    for flag in flags.values():
        flag["doc"] = "; ".join(f"{'/'.join(norms)}: {doc}" for doc, norms in flag.pop("docs").items())
        del flag["kinds"]
    return flags


def add_norm_flags(parser, options: dict[str, dict[str, tuple]] = OPTIONS) -> dict[str, dict]:
    """Add `--option` for every norm_flags(options) entry to `parser` (default None: not given); returns the flags."""
    flags = norm_flags(options)
    for option, flag in flags.items():
        name = "--" + option.replace("_", "-")
        if flag["type"] is None:
            parser.add_argument(name, dest=option, action="store_const", const=True, default=None, help=flag["doc"])
        else:
            parser.add_argument(name, dest=option, type=flag["type"], default=None, help=flag["doc"])
    return flags


def generated() -> str:
    """OPTIONS as this file writes it, from the registry (imports every norm, and so torch)."""
    import pprint

    return "OPTIONS = " + pprint.pformat(declared_options(), width=118, sort_dicts=False)


def derived_copies() -> dict:
    """{path: its text as the registry says it should read} for every file holding a copy of what the norms declare
    (a source checkout's: the docs are not installed), and norms/__init__.py's line importing every norm file."""
    from ..recipe import documentation_markdown

    repo = Path(__file__).resolve().parents[2]
    this, page, tree = Path(__file__).resolve(), repo / "docs/reference/recipe.md", repo / "docs/architecture.md"
    guide, readme = repo / "docs/patching.md", repo / "README.md"
    text = this.read_text()
    start, end = text.index("OPTIONS = "), text.index("\n\nTYPES = ")
    registry, registering = registering_line()
    return {registry: registering, this: text[:start] + generated() + text[end:],
            page: replace_table(page.read_text(), documentation_markdown()),
            tree: norm_tree_lines(tree.read_text()), guide: replace_table(guide.read_text(), norms_table()),
            readme: replace_table(readme.read_text(), norms_table(brief=True))}


def norms_table(brief: bool = False) -> str:
    """docs/patching.md's table of the norms: each one's summary, formula and options (with their docs); `brief`:
    the README's, each one's summary and its options' names."""
    from ..norms import describe_norms

    rows = ["| norm | what | options |", "| --- | --- | --- |"]
    for norm in describe_norms():
        if brief:
            options = ", ".join(f"`{o['name']}`" for o in norm["options"]) or "—"
            cells = (f"`{norm['name']}`", norm["summary"], options)
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
            continue
        options = "; ".join(f"`{o['name']}`: {o['doc']}" for o in norm["options"]) or "—"
        per_head = " Per head: `heads=` applies." if norm["per_head"] else ""
        cells = (f"`{norm['name']}`", f"{norm['summary']}: `{norm['formula']}`.{per_head}", options)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # a | inside: escaped
    return "\n".join(rows)


def replace_table(text: str, table: str) -> str:
    """`text` with its markdown table that starts `table`'s header line replaced by `table`."""
    lines, header = text.split("\n"), table.split("\n")[0]
    start = lines.index(header)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join([*lines[:start], table, *lines[end:]])


def norm_tree_lines(text: str) -> str:
    """docs/architecture.md with the tree's lines under `norms/` for the registered norms' files written from the
    registry (`NAME.py  summary`), after the files every norm shares."""
    from ..norms import NORMS

    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("  norms/ "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("    "))
    folder = Path(__file__).resolve().parents[1] / "norms"  # a removed norm's line goes, and a file's line stays
    shared = [line for line in lines[start + 1:end]
              if line.split()[0].removesuffix(".py") not in NORMS and (folder / line.split()[0]).is_file()]
    norms = [f"    {name}.py".ljust(34) + cls.summary for name, cls in sorted(NORMS.items())]
    return "\n".join([*lines[:start + 1], *shared, *norms, *lines[end:]])


NORM_IMPORT = re.compile(r"^from \. import [\w, ]+  # noqa: E402,F401$", re.M)  # norms/__init__.py's registering line


def norm_files() -> list[str]:
    """The modules of retrofit/norms/ that register a norm (a line `@register_norm`), read as text: no import."""
    folder = Path(__file__).resolve().parents[1] / "norms"
    return sorted(p.stem for p in folder.glob("*.py") if "\n@register_norm\n" in p.read_text())


def registering_line() -> tuple[Path, str]:
    """(norms/__init__.py, its text with the line that imports every norm file written from norm_files())."""
    path = Path(__file__).resolve().parents[1] / "norms" / "__init__.py"
    line = f"from . import {', '.join(norm_files())}  # noqa: E402,F401"
    return path, NORM_IMPORT.sub(line, path.read_text(), count=1)


def main() -> int:
    """Rewrite every stale derived copy; print what changed. The registering import first (from the files, importing
    no norm), so that the registry read for the other copies has a new norm file in it."""
    from ..io.atomic import atomic_write_text

    path, text = registering_line()
    if path.read_text() != text:
        atomic_write_text(path, text)
        print(f"rewrote {path}")
    stale = [(path, text) for path, text in derived_copies().items() if path.read_text() != text]
    for path, text in stale:
        atomic_write_text(path, text)
        print(f"rewrote {path}")
    if not stale:
        print("every derived copy is current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
