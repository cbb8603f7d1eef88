"""One PatchSpec (issue 41 item 1): every way of writing a patch builds one, its rules are checked there and nowhere
else, and it round-trips through its record. The layout checks at the end read the source (like test_layout.py), so
a second home for the spec's rules fails on the commit that adds it."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import retrofit
from retrofit import PatchSpec
from retrofit.errors import RetrofitError
from retrofit.patch_spec import CLI, EVAL, RECIPE, parse_flat
from tests.project.test_layout import MODULES, ROOT, _where
from tests.tiny import tiny_model


def test_parse_reads_the_norm_its_options_and_the_patch_fields():
    spec = PatchSpec.parse("avnorm:kind=layer,affine=true,eps=1e-6,layers=1-2+0")
    assert (spec.norm, spec.options, spec.layers) == ("avnorm", {"kind": "layer", "affine": True, "eps": 1e-6}, "1-2+0")
    assert PatchSpec.parse("softmax:rope=yarn:4").rope == {"rope_type": "yarn", "factor": 4.0}
    assert PatchSpec.parse("softmax1:sink=-1,heads=0+3,learnable=no").options == {"sink": -1.0, "learnable": False}
    assert PatchSpec.parse("psoftmax:p=2") == PatchSpec("psoftmax", {"p": 2})  # typed as the norm reads it
    assert parse_flat("avnorm:kind=rms,floor=null") == {"norm": "avnorm", "kind": "rms", "floor": None}


def test_record_round_trip_and_equality():
    """to_record is plain JSON with every option; from_record reads it back, and reads a checkpoint's
    config.retrofit (rope as the applied plan, the selection as indices) as the same patch."""
    spec = PatchSpec("softmax1", {"sink": -2}, rope="yarn:4", layers="1-2", heads=[0, 1])
    record = spec.to_record()
    assert record["options"] == {"learnable": False, "sink": -2.0, "stack": False}
    assert record["rope"] == {"rope_type": "yarn", "factor": 4.0} and record["layers"] == "1-2"
    assert PatchSpec.from_record(record) == spec
    assert PatchSpec("avnorm") == PatchSpec("avnorm", {"kind": "rms"})  # the default written out: the same patch
    assert PatchSpec("avnorm") != PatchSpec("avnorm", {"kind": "layer"})
    model = tiny_model("llama", num_hidden_layers=4)
    retrofit.patch(model, spec)
    again = PatchSpec.from_record(retrofit.patch_record(model))
    assert (again.norm, again.rope["rope_type"], again.layers, again.heads) == ("softmax1", "yarn", [1, 2], [0, 1])
    assert again.all_options() == spec.all_options()


def test_patch_takes_a_spec_alone():
    model = tiny_model("llama")
    report = retrofit.patch(model, PatchSpec.parse("psoftmax:p=3"))
    assert report.norm == "psoftmax" and report.options["p"] == 3.0
    retrofit.unpatch(model)
    with pytest.raises(RetrofitError, match="takes a PatchSpec alone"):
        retrofit.patch(model, PatchSpec("avnorm"), kind="layer")
    assert not retrofit.is_patched(model)


@pytest.mark.parametrize("names, fields, message", [
    (None, dict(rope="yarn:4", nope=True),
     "rope and nope together make no sense: nope removes the rotary embedding; choose one"),
    (CLI, dict(rope="yarn:4", nope=True),
     "--rope and --nope together make no sense: --nope removes the rotary embedding; choose one"),
    (RECIPE, dict(rope="yarn:4", nope=True), "patch: rope and nope together make no sense"),
    (None, dict(layers="1", nope=True), "nope removes positions from the whole model; it cannot be limited to some "
                                        "layers: drop layers= or nope"),
    (CLI, dict(layers="1", nope=True), "--nope removes positions from the whole model; it cannot be limited to some "
                                       "layers: drop --layers or --nope"),
    (RECIPE, dict(layers="1", nope=True), "patch: nope removes positions from the whole model"),
    (CLI, dict(norm="psoftmax", heads="0"),
     "--heads: psoftmax has no per-head parameters; --heads applies to avnorm, softmax1, ssmax"),
    (EVAL, dict(norm="ssmax", layers="1..2"), "the evaluation patch's layers: cannot read '1..2'"),
    (None, dict(norm="avnrm"), "unknown norm 'avnrm' (did you mean 'avnorm'?)"),
    (None, dict(options={"kinf": "rms"}), "norm 'avnorm' has no option 'kinf'"),
])
def test_each_rule_is_one_line_in_the_words_of_where_it_was_written(names, fields, message):
    fields = {"norm": "avnorm", **fields}
    with pytest.raises(RetrofitError) as err:
        PatchSpec(**fields, **({"names": names} if names else {}))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("avnorm:kind", "--patch 'avnorm:kind': options are key=value"),
    ("avnorm:kind=[[[", "kind='[[[' is not a value"),
    ("avnorm:=rms", "options are key=value"),
])
def test_parse_refuses_what_is_not_key_value(text, message):
    with pytest.raises(RetrofitError, match=message.replace("[", r"\[")):
        PatchSpec.parse(text)


@pytest.mark.parametrize("text, message", [
    ("avnorm:kind=rms,kind=layer", "kind is given twice ('rms', then 'layer'); give it once"),
    ("avnorm:layers=0,kind=rms,layers=1", "layers is given twice (0, then 1)"),
    ("softmax:norm=avnorm", "norm is given twice ('softmax', then 'avnorm')"),
])
def test_a_key_given_twice_is_refused_not_the_last_one_taken(text, message):
    """avnorm:kind=rms,kind=layer was read as kind=layer: the spec that loads must be the one written, so a key
    written twice is one line (it could be either), in PatchSpec.parse and in a recipe's patch section."""
    with pytest.raises(RetrofitError) as caught:
        PatchSpec.parse(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_every_entry_point_builds_the_same_spec(tmp_path):
    """The CLI's flags, the recipe's section, eval's and diagnose's --patch and the harness's arguments: one spec."""
    from retrofit.commands.patch import add_arguments
    from retrofit.diagnose.spec import parse_patches
    from retrofit.evaluate.spec import EvalSpec
    from retrofit.recipe import PatchSection

    wanted = PatchSpec("softmax1", {"sink": -1.0}, layers="1-2", heads="0+1")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["src", "--norm", "softmax1", "--sink", "-1", "--layers", "1-2", "--heads", "0+1"])
    options = {k: v for k, v in vars(args).items() if k in ("sink",) and v is not None}
    assert PatchSpec(args.norm, options, layers=args.layers, heads=args.heads, names=CLI) == wanted
    assert PatchSection(norm="softmax1", options={"sink": -1}, layers="1-2", heads="0+1").spec() == wanted
    [spec] = parse_patches(["softmax1:sink=-1,layers=1-2,heads=0+1"])
    assert spec == wanted
    [(_, patch)] = EvalSpec(lengths=[8], patch="softmax1:sink=-1,layers=1-2,heads=0+1").patches
    assert (patch["norm"], patch["options"], patch["layers"], patch["heads"]) == \
        ("softmax1", wanted.all_options(), "1-2", "0+1")


def test_every_entry_point_builds_the_same_gated_spec():
    """The gate (issue 55) as the CLI's --gate, the recipe's patch.gate, --patch's gate= and Python's gate=."""
    from retrofit.commands.patch import add_arguments
    from retrofit.diagnose.spec import parse_patches
    from retrofit.evaluate.spec import EvalSpec
    from retrofit.recipe import PatchSection

    wanted = PatchSpec("avnorm", {"kind": "layer"}, layers="1-2", gate={"kind": "head", "start": 0.5, "inputs": 12})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["src", "--norm", "avnorm", "--kind", "layer", "--layers", "1-2", "--gate", "head:0.5:12"])
    assert PatchSpec(args.norm, {"kind": args.kind}, layers=args.layers, gate=args.gate, names=CLI) == wanted
    assert PatchSection(norm="avnorm", options={"kind": "layer"}, layers="1-2", gate="head:0.5:12").spec() == wanted
    assert parse_patches(["avnorm:kind=layer,layers=1-2,gate=head:0.5:12"]) == [wanted]
    [(_, patch)] = EvalSpec(lengths=[8], patch="avnorm:kind=layer,layers=1-2,gate=head:0.5:12").patches
    assert patch["gate"] == wanted.gate and PatchSpec("avnorm", {"kind": "layer"}, layers="1-2") != wanted
    with pytest.raises(RetrofitError, match="patch.gate gates every head.*drop patch.heads or patch.gate"):
        PatchSection(norm="avnorm", heads="0", gate="head")


# ---- the spec's single home ------------------------------------------------------------------------------------------
HOME = ROOT / "patch_spec.py"
# The spec's rules, by the words of their errors: a second module raising one of them is checking the rule again.
RULE_WORDS = ("together make no sense", "has no per-head parameters", "removes positions from the whole model",
              "options are key=value", "takes a PatchSpec alone", "needs a norm: one of",
              "gates every head of the patched layers")
PATCH_FIELDS = {"nope", "rope", "layers", "heads", "gate"}


def home_violations(source: str, where: str, patch_module: bool = False) -> list[str]:
    """What in `source` belongs to the PatchSpec: a rule's error text, a syntax-only selection check
    (parse_selection(spec, None, ...)), or a patch call naming the spec's fields as keywords (build a PatchSpec)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{where}:{node.lineno} says {w!r}" for w in RULE_WORDS if w in node.value]
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func).rpartition(".")[2]
        if name == "parse_selection" and len(node.args) > 1 and ast.unparse(node.args[1]) == "None":
            found.append(f"{where}:{node.lineno} checks a selection's syntax")
        if name in ("patch", "patch_model") and not patch_module and PATCH_FIELDS & {k.arg for k in node.keywords}:
            found.append(f"{where}:{node.lineno} patches with {sorted(PATCH_FIELDS & {k.arg for k in node.keywords})}")
    return found


def test_the_patch_spec_has_one_home():
    """Only retrofit/patch_spec.py checks the spec's rules and the selection syntax; every other module builds a
    PatchSpec (retrofit.patch itself passes its keywords to PatchSpec.of)."""
    found = [line for path in MODULES.values() if path != HOME
             for line in home_violations(path.read_text(), _where(path), path == ROOT / "patching.py")]
    assert found == []


def test_the_home_check_catches_what_it_is_for():
    planted = ('def check(args):\n    if args.rope and args.nope:\n'
               '        raise RetrofitError("--rope and --nope together make no sense")\n'
               '    parse_selection(args.layers, None, "--layers")\n'
               '    patch(model, args.norm, nope=args.nope)\n')
    assert sorted(home_violations(planted, "planted.py")) == [
        "planted.py:3 says 'together make no sense'", "planted.py:4 checks a selection's syntax",
        "planted.py:5 patches with ['nope']"]
    assert home_violations(HOME.read_text(), "patch_spec.py")  # the home itself has them: the check is not vacuous


def test_no_module_but_the_home_parses_a_patch_string():
    """`NORM:KEY=VALUE` is read by PatchSpec.parse alone (the diagnose and eval copies are gone)."""
    assert not [p for p in MODULES.values() if p != HOME and "def parse_patch(" in Path(p).read_text()]
