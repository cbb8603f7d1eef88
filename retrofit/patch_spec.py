"""One patch, validated once: the norm, its options, nope, rope, layers, heads and gate (PEFT's `LoraConfig` for
retrofit).

    spec = PatchSpec.parse("avnorm:kind=rms,layers=16-29")      # eval/diagnose --patch, the harness
    spec = PatchSpec("psoftmax", {"p": 2}, rope="yarn:4")        # Python
    retrofit.patch(model, spec)                                   # or retrofit.patch(model, "psoftmax", p=2)
    PatchSpec.from_record(model.config.retrofit) == PatchSpec.from_record(spec.to_record())

Every way to write a patch builds one — `retrofit patch` flags, the recipe's patch section, `eval`/`diagnose --patch`,
the harness's model arguments, `retrofit.patch()` and a checkpoint's `config.retrofit` — and nothing else checks its
rules: a known norm with its own options (the norm's Options dataclass), rope xor nope, no layer selection with nope,
heads only for norms that act per head, the selection syntax, a gate (retrofit.gate) never with heads. What needs
the model (an index past its layers, RoPE it lacks, learned positions) is checked when the patch is applied
(retrofit.patch). The errors name each field as the user wrote it (`names`): `--heads` on the command line,
`patch.heads` in a recipe, `heads` in Python.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import InitVar, dataclass, field

from .errors import RetrofitError, quoted
from .gate import normalize_gate
from .norms import NORMS, get_norm, make_options
from .rope import normalize_rope
from .selection import parse_selection

FIELDS = ("norm", "options", "nope", "rope", "layers", "heads", "gate")  # what to_record writes
PATCH_KEYS = ("nope", "rope", "layers", "heads", "gate")  # a patch's keys besides the norm and its options


@dataclass(frozen=True)
class FieldNames:
    """How one place spells the spec's fields, so that its errors name what the user wrote there."""

    layers: str = "layers"
    heads: str = "heads"
    rope: str = "rope"
    nope: str = "nope"
    layers_flag: str = "layers="  # in "drop X or nope"
    heads_flag: str = "heads="    # in "X applies to ..."
    prefix: str = ""              # before a message about two fields ("patch: ")
    gate: str = "gate"


PYTHON = FieldNames()
CLI = FieldNames("--layers", "--heads", "--rope", "--nope", "--layers", "--heads", gate="--gate")
RECIPE = FieldNames("patch.layers", "patch.heads", "rope", "nope", "patch.layers", "patch.heads", "patch: ",
                  gate="patch.gate")
EVAL = FieldNames("the evaluation patch's layers", "the evaluation patch's heads", gate="the evaluation patch's gate")


def per_head_norms() -> list[str]:
    """The norms that act per head, the only ones `heads` selects heads of."""
    return [name for name, cls in sorted(NORMS.items()) if cls.per_head]


@dataclass(frozen=True, eq=False)
class PatchSpec:
    """A patch as retrofit.patch applies it; every field checked in __post_init__ (see the module doc)."""

    norm: str
    options: dict = field(default_factory=dict)  # the options given, typed as the norm reads them (p: 2 -> 2.0)
    nope: bool = False                            # remove positional information
    rope: dict | None = None                      # a RoPE extension, normalized ({rope_type, factor, ...})
    layers: str | int | list | None = None        # the selection as written (retrofit.selection); None = all
    heads: str | int | list | None = None
    gate: str | dict | None = None                # output gating (retrofit.gate), normalized ({kind, start, inputs})
    names: InitVar[FieldNames] = PYTHON

    def __post_init__(self, names: FieldNames):
        get_norm(self.norm)  # unknown norm -> closest name
        if not isinstance(self.options, dict):
            raise RetrofitError(f"the options of norm {self.norm!r} must be a mapping, got {quoted(self.options)}")
        options = {k: v for k, v in self.options.items() if v is not None}  # None = the norm's default
        made = make_options(self.norm, **options)  # unknown option (closest key), bad value -> the norm's words
        object.__setattr__(self, "options", {k: getattr(made, k) for k in options})
        object.__setattr__(self, "nope", bool(self.nope))
        s = names
        if self.rope is not None:
            object.__setattr__(self, "rope", normalize_rope(self.rope))
            if self.nope:
                raise RetrofitError(f"{s.prefix}{s.rope} and {s.nope} together make no sense: {s.nope} removes the "
                                    "rotary embedding; choose one")
        for key in ("layers", "heads"):  # the syntax and an empty selection; the range once the model is known
            if getattr(self, key) is not None:
                parse_selection(getattr(self, key), None, getattr(s, key))
        if self.layers is not None and self.nope:
            raise RetrofitError(f"{s.prefix}{s.nope} removes positions from the whole model; it cannot be limited to "
                                f"some layers: drop {s.layers_flag} or {s.nope}")
        if self.heads is not None and not NORMS[self.norm].per_head:
            raise RetrofitError(f"{s.heads}: {self.norm} has no per-head parameters; {s.heads_flag} applies to "
                                f"{', '.join(per_head_norms())}")
        object.__setattr__(self, "gate", normalize_gate(self.gate, s.gate))
        if self.gate is not None and self.heads is not None:
            raise RetrofitError(f"{s.prefix}{s.gate} gates every head of the patched layers, and {s.heads} keeps the "
                                f"other heads bitwise as they were: drop {s.heads_flag} or {s.gate}")

    def __eq__(self, other) -> bool:  # the same patch: options equal once the norm's defaults fill them in
        return isinstance(other, PatchSpec) and self.to_record() == other.to_record()

    __hash__ = None  # options and rope are dicts

    @property
    def norm_options(self):
        """The norm's Options dataclass built from `options` (defaults for the rest)."""
        return make_options(self.norm, **self.options)

    def all_options(self) -> dict:
        """Every option of the norm, the defaults included: what config.retrofit records."""
        return dataclasses.asdict(self.norm_options)

    def to_record(self) -> dict:
        """The spec as plain JSON: every option, the rope normalized, the selection as written."""
        return {"norm": self.norm, "options": self.all_options(), "nope": self.nope, "rope": self.rope,
                "layers": self.layers, "heads": self.heads, "gate": self.gate}

    @classmethod
    def of(cls, norm: str | PatchSpec | None, *, nope: bool = False, rope: str | dict | None = None,
           layers: str | int | list | None = None, heads: str | int | list | None = None,
           gate: str | dict | None = None, **options) -> PatchSpec:
        """retrofit.patch's arguments as a spec: a PatchSpec alone, or a norm's name with the rest as keywords."""
        if isinstance(norm, PatchSpec):
            if nope or rope is not None or layers is not None or heads is not None or gate is not None or options:
                raise RetrofitError("retrofit.patch takes a PatchSpec alone: put nope, rope, layers, heads, gate and "
                                    "the options in the spec")
            return norm
        if norm is None:
            raise RetrofitError(f"retrofit.patch needs a norm: one of {', '.join(sorted(NORMS))} (e.g. "
                                "retrofit.patch(model, 'softmax', rope='yarn:4'), or 'avnorm' then retrofit.calibrate)")
        return cls(norm, options, nope=nope, rope=rope, layers=layers, heads=heads, gate=gate)

    @classmethod
    def from_record(cls, record: dict, names: FieldNames = PYTHON) -> PatchSpec:
        """A spec from to_record's dict or a checkpoint's config.retrofit (whose rope is the applied plan: its
        `parameters` are the spec; its layers and heads the resolved indices)."""
        if not isinstance(record, dict) or "norm" not in record:
            raise RetrofitError("config.retrofit is not a retrofit patch record (no 'norm')")
        rope = record.get("rope")
        if isinstance(rope, dict) and "parameters" in rope:
            rope = rope["parameters"]
        return cls(record["norm"], dict(record.get("options") or {}), nope=bool(record.get("nope")), rope=rope,
                   layers=record.get("layers"), heads=record.get("heads"), gate=record.get("gate"), names=names)

    @classmethod
    def from_flat(cls, mapping: dict, names: FieldNames = PYTHON) -> PatchSpec:
        """{norm, nope, rope, layers, heads, gate, **options}: a patch written flat (eval's patch mapping, a
        variant)."""
        values = dict(mapping)
        fields = {k: values.pop(k) for k in PATCH_KEYS if k in values}
        return cls(values.pop("norm"), values, **fields, names=names)

    @classmethod
    def parse(cls, text: str, names: FieldNames = PYTHON, what: str = "--patch") -> PatchSpec:
        """'avnorm', 'psoftmax:p=2', 'avnorm:kind=layer,affine=true,layers=16-29+3,heads=0+1', 'softmax:rope=yarn:4',
        'avnorm:gate=head:0.5:12':
        NORM[:KEY=VALUE,...]; '+' joins a selection's items (the options split on commas)."""
        return cls.from_flat(parse_flat(text, what), names)


def parse_flat(text: str, what: str = "--patch") -> dict:
    """NORM[:KEY=VALUE,...] -> {"norm": NORM, KEY: value, ...}; a value is true/false, null, a number or a word."""
    if not isinstance(text, str):
        raise RetrofitError(f"{what} must be text like avnorm:kind=rms, got {quoted(text)}")
    name, _, rest = text.partition(":")
    flat: dict = {"norm": name.strip()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise RetrofitError(f"{what} {quoted(text, 40)}: options are key=value, e.g. avnorm:kind=layer")
        value = _value(value.strip(), key, text, what)
        if key in flat:  # either could be meant: the last one was taken, silently
            raise RetrofitError(f"{what} {quoted(text, 40)}: {key} is given twice ({quoted(flat[key])}, then "
                                f"{quoted(value)}); give it once")
        flat[key] = value
    return flat


def _value(text: str, key: str, whole: str, what: str):
    low = text.lower()
    if low in ("true", "yes", "false", "no"):
        return low in ("true", "yes")
    if low in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        return number if kind is int or not math.isnan(number) else text
    if not re.fullmatch(r"[\w.:+\-]+", text):  # a word (rms, yarn:4, 16-29+3); never a nested structure
        raise RetrofitError(f"{what} {quoted(whole, 40)}: {key}={quoted(text, 40)} is not a value: a value is a number "
                            "or a word, e.g. avnorm:kind=layer")
    return text


__all__ = ["CLI", "EVAL", "PATCH_KEYS", "PYTHON", "RECIPE", "PatchSpec", "FieldNames", "parse_flat", "per_head_norms"]
