"""One option schema (issue 63 item 1): each norm's options (name, type from its hint, default, doc, an example) are
read from Norm.option_schema by the CLI's flags, a checkpoint's record, the recipe's patch section and the name test;
register_norm refuses at import an option named like a patch key, one name with two types, or a type it cannot say.
Every registered norm is saved and reloaded with each of its options at a value other than its default."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest
import torch

import retrofit
from retrofit.cli import build_parser
from retrofit.commands.patch_flags import add_norm_flags, flag_type
from retrofit.errors import RetrofitError
from retrofit.load.validate import check_record
from retrofit.norms import NORMS, Norm, get_norm, make_options, register_norm
from retrofit.norms.base import option
from retrofit.norms.options import PATCH_KEYS
from retrofit.patch_spec import FIELDS, PatchSpec
from retrofit.patch_spec import PATCH_KEYS as SPEC_KEYS
from retrofit.recipe import PatchSection
from tests.tiny import random_ids, randomize_patch, tiny_model


@dataclass
class OffsetOptions:  # how a first sigmoid attention declared its bias (issue 63): a word or a number
    offset: str | float = option("-log n", "the offset b: -log n (n = the keys a query sees) or a number", example=-2.0)


@dataclass
class LayersOptions:
    layers: int = option(2, "clashes with the patch's layers=")


@dataclass
class GainAsTextOptions:
    gain: str = option("unit", "avnorm and psoftmax declare gain a number")


@dataclass
class TupleOptions:
    widths: tuple = option((1, 2), "no flag, record or recipe key can take a tuple")


@dataclass
class NullIntOptions:
    width: int = option(None, "a default of None needs `int | None`")


@dataclass
class UndocumentedOptions:
    width: int = 3


def _toy(options_cls: type, name: str = "toy") -> type[Norm]:
    return type("Toy", (Norm,), {"name": name, "summary": "a toy", "formula": "a = toy(s)", "Options": options_cls,
                                 "__module__": __name__})


@pytest.fixture
def registered_toy():
    """A toy norm with a `str | float` option, registered for the test only."""
    cls = register_norm(_toy(OffsetOptions))
    yield cls
    NORMS.pop(cls.name)


# ---- the schema is the type hints -----------------------------------------------------------------------------------

def test_the_schema_reads_each_type_from_its_hint_not_its_default():
    gain = next(o for o in get_norm("psoftmax").option_schema() if o.name == "gain")
    assert (gain.kinds, gain.optional, gain.default) == (("float",), True, None)
    assert gain.accepts(0.5) and gain.accepts(2) and gain.accepts(None) and not gain.accepts("0.5")
    assert gain.expects == "a number or null" and gain.flag_type == "float"
    affine = next(o for o in get_norm("avnorm").option_schema() if o.name == "affine")
    assert affine.kinds == ("bool",) and affine.flag_type is None and not affine.accepts(1)
    [offset] = _toy(OffsetOptions).option_schema()
    assert (offset.kinds, offset.optional, offset.flag_type, offset.expects) == (("str", "float"), False, "str|float",
                                                                         "a string or a number")
    assert offset.accepts("-log n") and offset.accepts(-2.0) and offset.accepts(-2)
    assert not offset.accepts(True) and not offset.accepts(None)


def test_every_reader_asks_the_schema():
    """The flag table, the recipe's keys and its reference rows are the schema's, option by option."""
    from retrofit.commands.patch_flags import declared_options

    rows = PatchSection.option_documentation("patch.")
    for name, cls in NORMS.items():
        schema = cls.option_schema()
        assert [o.name for o in schema] == [f.name for f in dataclasses.fields(cls.Options)]
        assert declared_options()[name] == {o.name: (o.flag_type, o.doc) for o in schema}
        assert all((f"patch.{o.name}", repr(o.default), f"{name}: {o.doc}") in rows for o in schema)
    assert len(rows) == sum(len(cls.option_schema()) for cls in NORMS.values())


def test_an_option_declared_str_or_float_reloads_as_either(registered_toy):
    """The trap issue 63 found: typed from its default's value, `offset: str | float = "-log n"` saved as a number
    failed to reload. The record, the recipe and the CLI now take both, and refuse what the hint does not allow."""
    for value in ("-log n", -2.0, -2):
        record = PatchSpec("toy", {"offset": value}).to_record()
        check_record(record, "config.json")
        assert PatchSection(norm="toy", options={"offset": value}).options == {"offset": value}
    with pytest.raises(RetrofitError, match=r"^config.json: retrofit.options.offset must be a string or a number, "
                                            r"got True$"):
        check_record({**PatchSpec("toy").to_record(), "options": {"offset": True}}, "config.json")
    with pytest.raises(RetrofitError, match=r"^patch.offset must be a string or a number, got True$"):
        PatchSection(norm="toy", options={"offset": True})
    parser = argparse.ArgumentParser()
    add_norm_flags(parser, {"toy": {"offset": ("str|float", "the offset")}})
    assert parser.parse_args(["--offset", "-0.5"]).offset == -0.5
    assert parser.parse_args(["--offset", "log"]).offset == "log"
    assert flag_type("int|float")("3") == 3 and flag_type("int|float")("0.5") == 0.5
    with pytest.raises(ValueError):
        flag_type("int|float")("wide")


# ---- register_norm refuses at import ------------------------------------------------------------------------------

@pytest.mark.parametrize("options_cls, message", [
    (LayersOptions, r"norm 'toy' option 'layers' is also a key of the patch itself \(flag --layers, patch.layers\)"),
    (GainAsTextOptions, r"norm 'toy' option 'gain' is str but norm 'avnorm' declares it float: one name takes one "
                        "type"),
    (TupleOptions, r"norm 'toy' option 'widths': type .*tuple.* is not an option's"),
    (NullIntOptions, r"norm 'toy' option 'width': its default None is not an integer"),
    (UndocumentedOptions, r"norm 'toy' option 'width': declare it as option\(default, \"what it does\"\)"),
], ids=["patch-key", "two-types", "tuple", "null-default", "no-doc"])
def test_register_norm_refuses_what_the_schema_cannot_hold(options_cls, message):
    before = dict(NORMS)
    with pytest.raises(RetrofitError, match=message) as err:
        register_norm(_toy(options_cls))
    assert "\n" not in str(err.value) and NORMS == before


def _flag_names(parser: argparse.ArgumentParser) -> set[str]:
    return {s[2:].replace("-", "_") for a in parser._actions for s in a.option_strings if s.startswith("--")} | \
        {a.dest for a in parser._actions if not a.option_strings and a.dest != argparse.SUPPRESS}


def test_the_patch_keys_are_every_key_a_patch_is_written_with():
    """PATCH_KEYS (norms/options.py, below the patch's own modules) is exactly PatchSpec's fields, the recipe's patch
    section's keys (and their old names) and `retrofit patch`'s own flags (and the top parser's)."""
    top = build_parser("patch")
    patch = top._subparsers._group_actions[0].choices["patch"]
    norm_flags = {o.name for cls in NORMS.values() for o in cls.option_schema()}
    keys = {f.name for f in dataclasses.fields(PatchSpec)} | set(FIELDS) | set(SPEC_KEYS)
    keys |= {f.name for f in dataclasses.fields(PatchSection)} | set(PatchSection.renamed)
    keys |= (_flag_names(patch) - norm_flags) | _flag_names(top)
    assert keys == PATCH_KEYS


# ---- every norm, every option changed, saved and reloaded ---------------------------------------------------------

CHANGED = [(name, o) for name, cls in sorted(NORMS.items()) for o in cls.option_schema()]


@pytest.mark.parametrize("norm, spec", CHANGED, ids=[f"{n}.{o.name}" for n, o in CHANGED])
def test_every_option_changed_survives_save_and_reload(one_thread, tmp_path, norm, spec):
    given = spec.example_options()
    assert given is not None, f"{norm}: declare option({spec.name!r}, ..., example=a value other than the default)"
    value = getattr(make_options(norm, **given), spec.name)
    assert value != spec.default, f"{norm}.{spec.name}: its example is its default"
    model = tiny_model("llama")
    retrofit.patch(model, norm, **given)
    randomize_patch(model)
    ids = random_ids(2, 10)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = retrofit.from_pretrained(str(tmp_path))
    assert loaded.config.retrofit == model.config.retrofit
    assert loaded.config.retrofit["options"][spec.name] == value
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)


def test_a_python_caller_is_held_to_the_schema_too():
    """make_options (retrofit.patch, PatchSpec) refuses what a record or recipe would: True for a number ("1.0"
    silently, before), a string for a number or a switch, in one line naming the option and its type."""
    for name, cls in NORMS.items():
        for spec in cls.option_schema():
            wrong = True if "bool" not in spec.kinds else "yes"
            with pytest.raises(RetrofitError, match=rf"^norm '{name}' option {spec.name} must be {spec.expects}, "):
                make_options(name, **{spec.name: wrong})
    with pytest.raises(RetrofitError, match=r"option sink must be a number, got '1.5'$"):
        make_options("softmax1", sink="1.5")
    assert make_options("psoftmax", p=2).p == 2.0  # an integer is a number
