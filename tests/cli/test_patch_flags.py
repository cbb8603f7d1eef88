"""`retrofit patch`'s norm flags are built from the norms' declared options (each norm's Options dataclass), and
from nothing else: a new option is a new flag with its doc, without an edit to the command line's code; the table
written out so that parsing imports no norm carries those options and names each norm once."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from retrofit.cli import build_parser
from retrofit.commands.patch_flags import OPTIONS, add_norm_flags, declared_options, norm_flags
from retrofit.norms import NORMS, Norm, available_norms
from retrofit.norms.base import option

ROOT = Path(__file__).resolve().parents[2]


class ToyNorm(Norm):
    """A norm as the registry holds it, with options of every kind a flag takes."""

    name = "toy"

    @dataclasses.dataclass
    class Options:
        width: int = option(3, "how many keys the toy sees")
        temperature: float | None = option(None, "divide the scores by it; null = 1")
        shape: str = option("flat", "flat | peaked")
        loud: bool = option(False, "say so")
        stack: bool = option(False, "the toy's own stacking")  # an option another norm declares too


def _patch_parser() -> argparse.ArgumentParser:
    return build_parser("patch")._subparsers._group_actions[0].choices["patch"]


def test_a_norms_declared_option_becomes_a_flag_with_its_doc(monkeypatch):
    """A norm added to the registry gets one flag per Options field, of the field's type (a bool is a switch), its
    help the field's doc under the norm's name: nothing in the command line names the norm or its options."""
    monkeypatch.setitem(NORMS, "toy", ToyNorm)
    table = declared_options()
    assert table["toy"] == {"width": ("int", "how many keys the toy sees"),
                            "temperature": ("float", "divide the scores by it; null = 1"),
                            "shape": ("str", "flat | peaked"), "loud": (None, "say so"),
                            "stack": (None, "the toy's own stacking")}
    parser = argparse.ArgumentParser()
    flags = add_norm_flags(parser, table)
    args = parser.parse_args(["--width", "5", "--temperature", "0.5", "--shape", "peaked", "--loud"])
    assert (args.width, args.temperature, args.shape, args.loud, args.stack) == (5, 0.5, "peaked", True, None)
    assert parser.parse_args([]).width is None  # not given: not passed on, the norm's default applies
    assert flags["width"]["norms"] == ["toy"] and flags["width"]["doc"] == "toy: how many keys the toy sees"
    assert "toy" in flags["stack"]["norms"] and "toy: the toy's own stacking" in flags["stack"]["doc"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--width", "wide"])  # the declared type is the flag's


def test_patch_has_exactly_the_registrys_options_as_flags():
    """`retrofit patch`'s norm flags are the union of every registered norm's options, each with its type; an option
    two norms declare is one flag whose help gives each norm's own doc."""
    declared = {o.name: o for cls in NORMS.values() for o in cls.option_schema()}
    actions = {a.dest: a for a in _patch_parser()._actions}
    flags = norm_flags()
    assert set(flags) == set(declared)
    for name, flag in flags.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert action.help == flag["doc"] and (action.const is True if flag["type"] is None else action.type)
        for norm in flag["norms"]:  # each norm that declares it, with its own words
            doc = next(o for o in NORMS[norm].option_schema() if o.name == name).doc
            assert f"{norm}: {doc}" in action.help, (name, norm)


def test_two_norms_may_not_give_one_option_two_types():
    table = {"a": {"width": ("int", "keys")}, "b": {"width": ("float", "a fraction of the keys")}}
    with pytest.raises(ValueError, match="norms 'a' and 'b' declare option 'width' with different types"):
        norm_flags(table)


def test_the_written_table_names_each_norm_once_as_the_key_of_its_options():
    """The table written out for a fast parser holds the options' metadata and no other knowledge of the norms:
    a norm's name appears once, as its key in OPTIONS (the --norm help lists those keys)."""
    tree = ast.parse((ROOT / "retrofit/commands/patch_flags.py").read_text())
    names = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in NORMS]
    assert sorted(names) == available_norms() == sorted(OPTIONS)
    assert "--norm NORM" in _patch_parser().format_usage()
    assert " | ".join(available_norms()) in next(a.help for a in _patch_parser()._actions if a.dest == "norm")
