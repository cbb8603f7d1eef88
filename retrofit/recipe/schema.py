"""Dataclasses from plain YAML data, with one-line errors: the machinery under retrofit.recipe.

    field: int = setting(3, "what it means")     # a documented field: a recipe setting
    build(Section, {"field": 4}, "section")      # -> Section(field=4); wrong type or key: RetrofitError
    apply_overrides(raw, ["section.field=5"])    # dotted overrides onto the raw mapping, values as YAML
    documentation(Section)                       # (dotted key, default, doc) rows, nested included

The "scheduled option" of a norm (its class attribute `scheduled_option`) is the one option a recovery schedule moves
(retrofit.recovery); older text calls it the knob.

Supported field types: bool, int, float, str, Any, dict, list[T], Literal[...], unions with None, and
nested dataclasses. An unknown key names the closest valid one. YAML is read with load_yaml (retrofit.io.readers):
bounded in depth, in what its aliases expand to and in the digits of its numbers, so a small file cannot make a
billion values (or a RecursionError, or a traceback from int()).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal

import yaml

from ..errors import RetrofitError, quoted
from ..errors import closest as _closest
from ..io.readers import MAX_FILE_BYTES, load_json, load_yaml, read_yaml_file  # noqa: F401  (re-exported)

_MISSING = dataclasses.MISSING


def setting(default=_MISSING, doc: str = "", *, factory=None):
    """A recipe field with its documentation (`retrofit train RECIPE --keys` and the tests read it)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def require(ok: bool, message: str) -> None:
    if not ok:
        raise RetrofitError(message)


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}
        return f"a list of {plural.get(args[0], _describe(args[0]))}" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp)))


_SCALARS = {bool: bool, int: int, float: (int, float), str: str}


def _coerce(value, tp, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = RetrofitError(f"{path} must be {_describe(tp)}, got {quoted(value)}")
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path)
            except RetrofitError as err:
                last = err
        raise last if len(args) == 2 else bad
    if origin is Literal:
        if value not in args:
            raise RetrofitError(f"{path} must be one of {', '.join(map(str, args))}, got {quoted(value)}"
                                f"{_closest(value, map(str, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return build(tp, value, path)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string: take what float() takes
        try:
            return float(value)
        except ValueError:
            raise bad from None
    if tp in _SCALARS:  # bool is an int in Python, but `steps: true` is a mistake, not 1
        if not isinstance(value, _SCALARS[tp]) or (isinstance(value, bool) and tp is not bool):
            raise bad
        return float(value) if tp is float else value
    raise TypeError(f"recipe schema uses an unsupported type {tp!r} at {path}")


def build(cls, data: dict, path: str):
    """Build dataclass `cls` from a mapping; unknown keys name the closest valid key. A key the class lists in its
    `renamed` (old name -> new) is read under its new name, so recipes and saved runs written before still load."""
    renamed = getattr(cls, "renamed", {})
    data = {renamed.get(key, key): value for key, value in data.items()}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    rest = getattr(cls, "pass_through", None)  # a dict field collecting keys the class validates itself
    passed = {}
    for key in data:
        if key not in names and rest is not None:
            passed[key] = data[key]
        elif key not in names:
            where = f"{path}." if path else ""
            raise RetrofitError(f"unknown recipe key {where}{key}{_closest(key, names)}; valid keys"
                                f"{' in ' + path if path else ''}: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items() if k not in passed}
    if passed:
        kwargs[rest] = {**kwargs.get(rest, {}), **passed}
    return cls(**kwargs)


def _dataclass_in(tp):
    """The dataclass a field holds (itself, optional, or as list items), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next((d for d in map(_dataclass_in, typing.get_args(tp)) if d is not None), None)


def check_keys(cls, data, path: str) -> None:
    """Every key of `data` (nested sections and lists of them included) a field of `cls`, else the one-line error
    build() gives; values are not read. It needs only the classes' annotations, so a recipe's typo is refused before
    its values' checks import the norms and torch (issue 62: 8-10 s to reject a misspelled key)."""
    if not isinstance(data, dict):
        return  # build() names the wrong type
    renamed = getattr(cls, "renamed", {})
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key, value in data.items():
        key = renamed.get(key, key)
        if key not in names:
            if getattr(cls, "pass_through", None) is not None:
                continue  # the class validates these itself (a norm's options)
            where = f"{path}." if path else ""
            raise RetrofitError(f"unknown recipe key {where}{key}{_closest(key, names)}; valid keys"
                                f"{' in ' + path if path else ''}: {', '.join(names)}")
        nested = _dataclass_in(hints[key])
        if nested is None:
            continue
        where = f"{path}.{key}" if path else key
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            check_keys(nested, item, where if i is None else f"{where}[{i}]")


def to_plain(obj):
    """A dataclass tree as plain YAML data (a pass-through dict is written flat, as it is read)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = to_plain(getattr(obj, f.name))
            if f.name == getattr(obj, "pass_through", None):
                out.update(value)
            else:
                out[f.name] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def apply_overrides(raw: dict, overrides) -> dict:
    """`train.steps=200 patch.p=2` onto the raw mapping (values parsed as YAML: 2 -> int, [1,2] -> list)."""
    for item in overrides:
        require("=" in item, f"override {item!r} must look like section.key=value (e.g. train.steps=200)")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        require(all(keys), f"override {item!r} has an empty key")
        try:
            value = load_yaml(text, f"override {dotted.strip()}") if text.strip() else None
        except yaml.YAMLError:
            value = text
        node = raw
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
    return raw


def documentation(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field, nested sections included."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.name == getattr(cls, "pass_through", None) and hasattr(cls, "option_documentation"):
            rows.extend(cls.option_documentation(prefix))  # the class documents its pass-through keys
            continue
        tp = hints[f.name]
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        default = f.default if f.default is not _MISSING else "..."
        rows.append((key, repr(default), f.metadata.get("doc", "")))
        if nested:
            rows.extend(documentation(nested[0], key + "."))
    return rows
