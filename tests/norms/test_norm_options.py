"""Each norm option is declared once, in its norm's Options dataclass; the CLI (`retrofit patch --opt`), a
recipe (`patch.opt`) and Python (`retrofit.patch(model, norm, opt=...)`) all take exactly those options."""

from __future__ import annotations

import dataclasses

import pytest

import retrofit
from retrofit.cli import build_parser
from retrofit.commands.patch import NORM_FLAGS
from retrofit.errors import RetrofitError
from retrofit.norms import NORMS, make_options
from retrofit.recipe import recipe_from_dict, recipe_to_dict
from tests.tiny import tiny_model


def _options():
    """(norm, option, options that give it a valid value other than its default: its schema's example, which names
    the options it applies beside, e.g. ssmax beta with scale=llama4) for every option of every registered norm."""
    for norm, cls in sorted(NORMS.items()):
        for spec in cls.option_schema():
            yield norm, spec.name, spec.example_options()


OPTIONS = list(_options())


def _recipe(patch: dict):
    return recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "patch": patch,
                             "data": {"task": "counting"}})


def _cli_options(argv: list[str]) -> dict:
    args = build_parser("patch").parse_args(["patch", "some-model", *argv])
    return {k: getattr(args, k) for k in NORM_FLAGS if getattr(args, k) is not None}


def _cli_argv(option: str, value) -> list[str]:
    flag = "--" + option.replace("_", "-")
    return [flag] if value is True else [flag, str(value)]


def test_the_cli_has_one_flag_per_option_and_no_other():
    declared = {o.name for cls in NORMS.values() for o in cls.option_schema()}
    assert set(NORM_FLAGS) == declared
    for option, spec in NORM_FLAGS.items():
        assert spec["norms"] == sorted(n for n, cls in NORMS.items()
                                       if option in {o.name for o in cls.option_schema()})


@pytest.mark.parametrize("norm, option, given", OPTIONS, ids=[f"{n}.{o}" for n, o, _ in OPTIONS])
def test_cli_recipe_and_python_accept_the_same_option_alike(norm, option, given):
    python = make_options(norm, **given)
    assert getattr(python, option) != getattr(make_options(norm), option)  # not the default: a test that can fail
    argv = [a for k, v in given.items() for a in _cli_argv(k, v)]
    from_cli = make_options(norm, **_cli_options(["--norm", norm, *argv]))
    recipe = _recipe({"norm": norm, **given})
    from_recipe = make_options(norm, **recipe.patch.options)
    assert python == from_cli == from_recipe
    model = tiny_model("llama")
    retrofit.patch(model, norm, **given)
    assert model.config.retrofit["options"] == dataclasses.asdict(python)
    assert recipe_to_dict(recipe)["patch"][option] == getattr(python, option)  # saved flat, as it is written


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_an_option_of_another_norm_is_refused_by_all_three(norm):
    own = {o.name for o in NORMS[norm].option_schema()}
    foreign = next(((o, given[o]) for n, o, given in OPTIONS if o not in own), None)
    assert foreign is not None
    option, value = foreign
    with pytest.raises(RetrofitError, match=f"has no option '{option}'"):
        make_options(norm, **{option: value})
    with pytest.raises(RetrofitError, match=f"has no option '{option}'"):
        make_options(norm, **_cli_options(["--norm", norm, *_cli_argv(option, value)]))
    with pytest.raises(RetrofitError, match=f"has no option '{option}'"):
        _recipe({"norm": norm, option: value})
    with pytest.raises(RetrofitError, match=f"has no option '{option}'"):
        retrofit.patch(tiny_model("llama"), norm, **{option: value})


def test_a_recipe_typo_in_the_patch_section_names_the_closest_key():
    with pytest.raises(RetrofitError, match=r"unknown recipe key patch.nop \(did you mean 'nope'\?\)"):
        _recipe({"norm": "avnorm", "nop": True})
    with pytest.raises(RetrofitError, match=r"patch.kindd \(did you mean 'kind'\?\)"):
        _recipe({"norm": "avnorm", "kindd": "layer"})


def test_psoftmax_has_parameters_exactly_when_it_has_a_gain():
    with_gain, without = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(with_gain, "psoftmax", gain=1.0)
    retrofit.patch(without, "psoftmax")
    norms = [m for m in with_gain.modules() if isinstance(m, retrofit.norms.Norm)]
    assert norms and all(n.has_parameters for n in norms)
    assert not any(n.has_parameters for n in without.modules() if isinstance(n, retrofit.norms.Norm))
