"""Reading JSON and YAML someone else wrote: data of the expected shape, or a one-line error naming the file.

    result = read_json(run / "result.json", what="retrofit info")       # a mapping, or refused in one line
    raw = read_yaml(run / "recipe.yaml", kind="a recipe is a mapping of sections")
    value = load_yaml(text, "override train.steps")                     # bounded YAML from text
    data = load_json(text, "token file x.json")                         # bounded JSON from text

Every file retrofit reads back from a folder (results.json, result.json, meta.json, retrofit.json, adapter_config.json,
task.json, recipe.yaml, ...) or takes from a user (a --variants list, a token file) goes through here: a regular UTF-8
file of at most MAX_FILE_BYTES (errors.read_utf8), its nesting and alias expansion bounded, every integer at most
MAX_DIGITS digits (Python refuses to convert 4,301 or more: a traceback from deep inside json or yaml), and its
top-level type checked before anyone indexes it (a list where a mapping belongs was an AttributeError).
"""

from __future__ import annotations

import json

import yaml

from ..errors import RetrofitError, quoted, read_utf8

# ---- bounds -------------------------------------------------------------------------------------------------------
# A recipe is a few levels of sections and keys and at most some thousands of values. Aliases (*a) share one node
# many times, so a 500-byte file can stand for 9**9 values ("billion laughs"): count values as if every alias
# were written out and refuse beyond these bounds before anything is built from them.
MAX_DEPTH = 32
MAX_VALUES = 100_000
MAX_FILE_BYTES = 16 << 20  # a file a user hands in or a run keeps (recipes are some KB, results.json some MB)
# The longest integer retrofit reads: a seed is 10 digits, a token count 12. int() of 4,301+ digits raises.
MAX_DIGITS = 100
TYPES = {dict: "a mapping", list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
         type(None): "empty (null)"}


def type_name(value) -> str:
    """'a mapping', 'a list', ... : what a value of JSON or YAML is, in the words of an error."""
    return next((name for kind, name in TYPES.items() if type(value) is kind), type(value).__name__)


def _too_many_digits(text: str, what: str) -> RetrofitError:
    return RetrofitError(f"{what} holds a number of {len(text.lstrip('-')):,} digits; a number retrofit reads has at "
                         f"most {MAX_DIGITS} (fix or remove that value)")


class _TooLarge(Exception):
    """A bound was crossed (message, line); load_yaml turns it into a one-line RetrofitError."""


class _Twice(Exception):
    """A mapping holds one key twice (key, line); load_yaml turns it into a one-line RetrofitError."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses to nest deeper than MAX_DEPTH (PyYAML composes recursively: a file
    nested 1000 deep is a RecursionError otherwise) and whose integers have at most MAX_DIGITS digits."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _TooLarge(f"nests deeper than {MAX_DEPTH} levels", self.peek_event().start_mark.line + 1)
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if isinstance(node, yaml.MappingNode):  # as written: merges (<<: *base) are applied later, when constructed
            _once_each(node)
        return node

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_DIGITS + 3:  # a sign and 0x / 0o prefixes aside
            raise _TooLarge(f"holds a number of {len(node.value):,} digits (at most {MAX_DIGITS})",
                            node.start_mark.line + 1)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _once_each(node: yaml.MappingNode) -> None:
    """PyYAML keeps the last of two equal keys (`kind: rms` then `kind: layer` is kind=layer, silently): a key
    written twice in one mapping is refused. A merge (`<<: *base`) may still be overridden by the keys beside it."""
    seen = set()
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            if key.value in seen:
                raise _Twice(key.value, key.start_mark.line + 1)
            seen.add(key.value)


def _expanded(node, depth: int, seen: dict) -> tuple[int, int]:
    """(values, height) of `node` with every alias written out; a cycle (&a [*a]) counts as too deep. `seen`
    holds finished nodes by id, so shared nodes cost one visit and recursion stays within MAX_DEPTH."""
    done = seen.get(id(node))
    if done is None:
        if depth > MAX_DEPTH:
            raise _TooLarge(f"nests deeper than {MAX_DEPTH} levels (aliases written out)", node.start_mark.line + 1)
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        values, height = 1, 0
        for child in children:
            count, tall = _expanded(child, depth + 1, seen)
            values, height = values + count, max(height, tall)
            if values > MAX_VALUES:
                raise _TooLarge(f"expands to more than {MAX_VALUES:,} values through its aliases (*name)",
                                node.start_mark.line + 1)
        done = seen[id(node)] = (values, height + 1)
    if depth + done[1] - 1 > MAX_DEPTH:
        raise _TooLarge(f"nests deeper than {MAX_DEPTH} levels (aliases written out)", node.start_mark.line + 1)
    return done


# ---- from text ----------------------------------------------------------------------------------------------------

def load_yaml(text: str, what: str, kind: str = "a recipe is a few levels of sections and keys"):
    """yaml.safe_load, bounded: deeper than MAX_DEPTH, more than MAX_VALUES values once aliases are expanded or an
    integer of more than MAX_DIGITS digits is a one-line RetrofitError naming `what` (the file or override) and the
    line. yaml.YAMLError passes through. `kind` says what the text should look like (the end of the error)."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded(node, 1, {})
        return loader.construct_document(node)
    except _TooLarge as err:
        message, line = err.args
        raise RetrofitError(f"{what} {message} (line {line}); {kind}, write it out plainly") from None
    except _Twice as err:
        key, line = err.args
        raise RetrofitError(f"{what}: {key[:60]} is given twice (line {line}); give it once") from None
    finally:
        loader.dispose()


def load_json(text, what: str):
    """json.loads of a user's file, bounded: nested deeper than Python's recursion limit or an integer of more than
    MAX_DIGITS digits is a one-line error naming `what`, not a traceback (JSON has no aliases: its size is its
    file's size). Invalid JSON is a one-line error too."""
    def integer(digits: str) -> int:
        if len(digits) > MAX_DIGITS + 1:
            raise _too_many_digits(digits, what)
        return int(digits)

    try:
        return json.loads(text, parse_int=integer)
    except RecursionError:
        raise RetrofitError(f"{what} nests too deep to read; a file retrofit reads is a few levels deep") from None
    except json.JSONDecodeError as err:
        raise RetrofitError(f"{what}: cannot read it as JSON ({err.msg}: line {err.lineno} column {err.colno}); "
                            "restore it or write it again") from None


def expect(value, kind: type, what: str):
    """`value` when it is of `kind` (dict, list), else the one-line error naming what it holds instead."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RetrofitError(f"{what} holds {type_name(value)}, not {TYPES.get(kind, kind.__name__)}: "
                            f"{quoted(value, 40)}; it was not written by retrofit (restore it or write it again)")
    return value


# ---- from files ---------------------------------------------------------------------------------------------------

def read_json(path, kind: type = dict, *, what: str = ""):
    """The JSON file at `path` as a value of `kind` (default a mapping), bounded as load_json reads it; `what` (a
    flag, or empty) leads the error, which names the file."""
    label = f"{what} {path}".strip()
    return expect(load_json(read_utf8(path, what, most=MAX_FILE_BYTES), label), kind, label)


def read_yaml(path, kind: type = dict, *, what: str = "", shape: str = "a retrofit file is a few levels deep"):
    """The YAML file at `path` as a value of `kind` (default a mapping; an empty file is an empty one), bounded as
    load_yaml reads it; `shape` ends an error about its size."""
    label = f"{what} {path}".strip()
    value = read_yaml_file(path, what, shape)
    return expect({} if value is None and kind is dict else value, kind, label)


def read_yaml_file(path, what: str, kind: str):
    """A YAML file a user hands in (a --variants list, a recipe): a regular file of at most MAX_FILE_BYTES, UTF-8,
    read with load_yaml. Every error is one line naming `what` and the file."""
    text = read_utf8(path, what, most=MAX_FILE_BYTES)
    try:
        return load_yaml(text, f"{what} {path}".strip(), kind)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RetrofitError(f"{what} {path} is not valid YAML{where}: {getattr(err, 'problem', err)}".strip()) \
            from None


__all__ = ["MAX_DIGITS", "MAX_FILE_BYTES", "expect", "load_json", "load_yaml", "read_json", "read_yaml",
           "read_yaml_file", "type_name"]
