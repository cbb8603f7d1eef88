"""The norm registry: every normalization is one file in this package that registers itself by name.

    from retrofit.norms import get_norm, available_norms
    norm_cls = get_norm("avnorm")              # the nn.Module class attached to each attention module
    options = make_options("avnorm", kind="layer")   # its Options dataclass, validated

A norm module lives at `<attention module>.retrofit`. A norm that changes the weights (p-softmax, SSMax,
softmax+1) is called by the attention function that `retrofit.patch` registers with transformers, as
`norm(module, query, key, value, attention_mask, base=<wrapped kernel>, scaling=..., dropout=..., **kwargs)`,
returning `(out (B, Tq, H, D), weights or None)` exactly like a transformers attention function. A norm of the
heads' outputs (AVNorm, `acts_on_output = True`) is a forward pre-hook on the output projection instead,
`norm(out (B, T, H, D)) -> out`, so it works over any attention implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import RetrofitError, closest
from .base import AttentionShape, Norm
from .options import OptionSpec, check_schema

NORMS: dict[str, type[Norm]] = {}


def register_norm(cls: type[Norm]) -> type[Norm]:
    """Class decorator: make `cls` available under `cls.name`. Its options are checked here, at import: a patch key
    as an option's name, or a name another norm declares with another type, is refused (options.check_schema)."""
    if cls.name in NORMS:
        raise ValueError(f"norm {cls.name!r} is registered twice")
    check_schema(cls.name, cls.option_schema(), {name: other.option_schema() for name, other in NORMS.items()})
    NORMS[cls.name] = cls
    return cls


def available_norms() -> list[str]:
    return sorted(NORMS)


def baseline_norm() -> str:
    """The name of the norm that is the model's own attention (Norm.baseline): the control arm, what an unpatched
    model is labelled, what a RoPE extension alone patches with."""
    return next(name for name, cls in sorted(NORMS.items()) if cls.baseline)


def patched_norms() -> list[str]:
    """Every norm but the baseline: what benchmarks compare with the unpatched model."""
    return [name for name in available_norms() if not NORMS[name].baseline]


def calibrated_norm_hints() -> str:
    """'avnorm, or psoftmax with gain=1 (--gain 1)': how to ask for each norm calibration can set, for errors."""
    hints = [cls.calibration_hint for _, cls in sorted(NORMS.items()) if cls.calibration_hint]
    return ", or ".join(hints)


# Names people use for a norm (papers, posts, other libraries) -> what to write here. difflib alone would send
# `l2softmax` to softmax, the one norm it is not.
NEAR_MISSES = {
    **dict.fromkeys(["l2softmax", "l2-softmax", "l2_softmax", "l2", "lp2", "p2", "psoftmax2", "softmax2"],
                    "L2 softmax is psoftmax with p=2: --norm psoftmax --p 2, --patch psoftmax:p=2, "
                    "patch(model, 'psoftmax', p=2)"),
    **dict.fromkeys(["lpsoftmax", "lp-softmax", "lp_softmax", "p-softmax", "p_softmax", "pnorm", "lp"],
                    "did you mean 'psoftmax'? p >= 1, e.g. psoftmax:p=2"),
    **dict.fromkeys(["scalable-softmax", "scalable_softmax", "scalablesoftmax", "ss-max", "ss_max", "ssm",
                     "scalable", "logn", "log-n"], "did you mean 'ssmax'? Scalable-Softmax"),
    **dict.fromkeys(["softmax+1", "softmax-plus-one", "softmax_plus_one", "softmaxplusone", "softmax_1", "softmax-1",
                     "quiet-softmax", "quietsoftmax", "quiet_softmax", "off-by-one", "sink", "attention-sink"],
                    "did you mean 'softmax1'? softmax+1"),
    **dict.fromkeys(["av-norm", "av_norm", "avn", "headnorm", "head-norm", "rmsnorm", "groupnorm", "layernorm"],
                    "did you mean 'avnorm'? kind=rms, layer or global"),
    **dict.fromkeys(["nope", "no-pe", "no_pe"], "NoPE is not a norm: add --nope (nope=True) to any norm"),
    **dict.fromkeys(["l1", "l1softmax", "none", "original", "baseline", "vanilla"],
                    "did you mean 'softmax'? the unpatched baseline"),
}


def get_norm(name: str) -> type[Norm]:
    if name not in NORMS:
        near = NEAR_MISSES.get(str(name).strip().lower()) if isinstance(name, str) else None
        hint = f" ({near})" if near else closest(name, NORMS)
        raise RetrofitError(f"unknown norm {name!r}{hint}; available: {', '.join(available_norms())}")
    return NORMS[name]


def make_options(name: str, **options: Any):
    """Build and validate the Options dataclass of norm `name`; unknown keys name the closest valid key, and a value
    of another type than the option's schema says (True for a number, "1.5" for a number) is refused, as in a
    checkpoint's record or a recipe."""
    cls = get_norm(name).Options
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        if key not in valid:
            hint = closest(key, valid)
            allowed = ", ".join(valid) if valid else "none"
            raise RetrofitError(f"norm {name!r} has no option {key!r}{hint}; its options: {allowed}")
    schema = {spec.name: spec for spec in get_norm(name).option_schema()}
    for key, value in options.items():  # the type a record or recipe is held to, for a Python caller too
        if not schema[key].accepts(value):
            raise RetrofitError(f"norm {name!r} option {key} must be {schema[key].expects}, got {value!r}")
    try:
        return cls(**options)
    except TypeError as err:  # a wrong type that __post_init__ did not catch
        raise RetrofitError(f"bad options for norm {name!r}: {err}") from None


def describe_norms() -> list[dict]:
    """Every norm with its formula, whether heads= applies (per_head) and its options (name, type as a record holds
    it, default, doc), for `retrofit norms` and the docs."""
    rows = []
    for name in available_norms():
        cls = NORMS[name]
        options = [{"name": o.name, "type": o.expects, "default": o.default, "doc": o.doc} for o in cls.option_schema()]
        rows.append({"name": name, "summary": cls.summary, "formula": cls.formula, "per_head": cls.per_head,
                     "options": options})
    return rows


# Importing the files registers the norms. Keep this list and the files in sync (a test checks it).
from . import avnorm, psoftmax, sigmoid, softmax, softmax1, ssmax  # noqa: E402,F401

__all__ = [
    "NORMS", "AttentionShape", "Norm", "OptionSpec", "available_norms", "baseline_norm", "calibrated_norm_hints",
    "describe_norms", "get_norm", "make_options", "patched_norms", "register_norm",
]
