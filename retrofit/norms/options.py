"""A norm's options as one schema: each field of its Options dataclass, `name: type = option(default, "doc")`.

    from retrofit.norms import get_norm
    get_norm("psoftmax").option_schema()   # (OptionSpec(name='p', kinds=('float',), optional=False, ...), ...)

The type is the field's type hint, never its default's value: `bias: str | float = "-log n"` takes a string or a
number. Everything that reads an option asks this schema: `retrofit patch`'s flags (commands/patch_flags.py writes
it out), a checkpoint's record (load/validate.check_record), the recipe's patch section and its reference page, and
the test that no norm is named outside its file. register_norm checks each norm's schema at import
(check_schema): an option needs a default, a doc and a type the schema can say, may not be one of the patch's own
keys (PATCH_KEYS), and one name means one type across every norm.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..errors import RetrofitError

KINDS = {bool: "bool", int: "int", float: "float", str: "str"}  # the JSON types an option may take
WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}  # ... in an error

# The keys a patch is written with beside its norm's options, in every spelling: PatchSpec's fields, the recipe's
# patch section (with `calibrate`, its older name for calibrate_tokens) and `retrofit patch`'s own flags (with the
# top parser's: `command` is where the verb is parsed to). An option named like one would be two flags (`--out`) or
# two keys (patch.layers). tests/norms/test_option_schema.py holds this equal to those three places.
PATCH_KEYS = frozenset({
    "norm", "options", "nope", "rope", "layers", "heads", "gate", "calibrate", "calibrate_tokens",
    "source", "calibration_text", "check_text", "check_tokens", "rank", "rank_k", "schedule_values", "schedule_start",
    "schedule_end", "out", "push_to_hub", "dtype", "no_progress", "quiet", "help", "command", "local_rank", "version",
})


@dataclass(frozen=True)
class OptionSpec:
    """One option of a norm: what every reader of it (flags, records, recipes) is built from."""

    name: str
    kinds: tuple[str, ...]  # "bool" | "int" | "float" | "str", as the hint declares them (a union: several)
    optional: bool          # the hint allows None (`float | None`): null stands for "the norm's default"
    default: Any
    doc: str
    elsewhere: str = ""     # what else in retrofit this word names (option(..., elsewhere=)); "" = only this option
    example: Any = None     # option(..., example=): a value other than the default, or options that show one

    def example_options(self) -> dict | None:
        """Options that give this one a value other than its default (what the reload test patches with): the
        declared example, as {name: value} unless it is a mapping already; a switch's opposite; None if undeclared."""
        if isinstance(self.example, dict):
            return dict(self.example)
        if self.example is None and self.kinds == ("bool",):
            return {self.name: not self.default}
        return None if self.example is None else {self.name: self.example}

    @property
    def flag_type(self) -> str | None:
        """The flag's type as patch_flags.OPTIONS writes it: None = a switch (bool), else the kinds joined by '|'."""
        return None if self.kinds == ("bool",) else "|".join(self.kinds)

    def accepts(self, value) -> bool:
        """Whether `value`, as JSON or YAML gives it, is of this option's type (a string is never a number or a bool;
        an integer is a number)."""
        if value is None:
            return self.optional
        if isinstance(value, bool):
            return "bool" in self.kinds
        if isinstance(value, int):
            return "int" in self.kinds or "float" in self.kinds
        if isinstance(value, float):
            return "float" in self.kinds
        return isinstance(value, str) and "str" in self.kinds

    @property
    def expects(self) -> str:
        """What a value must be, in words: 'a number or null', 'a string or a number'."""
        return " or ".join([WORDS[kind] for kind in self.kinds] + (["null"] if self.optional else []))


def option_schema(options_cls: type, norm: str = "a norm") -> tuple[OptionSpec, ...]:
    """The OptionSpec of every field of `options_cls` (a norm's Options dataclass), in declared order; a field the
    schema cannot describe is a one-line RetrofitError naming the norm and the field."""
    hints = typing.get_type_hints(options_cls)
    specs = []
    for field in dataclasses.fields(options_cls):
        where = f"norm {norm!r} option {field.name!r}"
        args = typing.get_args(hints[field.name]) or (hints[field.name],)
        kinds = tuple(KINDS.get(t) for t in args if t is not type(None))
        if not kinds or None in kinds or ("bool" in kinds and len(kinds) > 1):
            raise RetrofitError(f"{where}: type {hints[field.name]} is not an option's: bool, int, float, str, a "
                                "union of int, float and str, each maybe `| None`")
        if field.default is dataclasses.MISSING or not (field.metadata or {}).get("doc"):
            raise RetrofitError(f"{where}: declare it as option(default, \"what it does\") (norms/base.py)")
        spec = OptionSpec(field.name, kinds, type(None) in args, field.default, field.metadata["doc"],
                          field.metadata.get("elsewhere", ""), field.metadata.get("example"))
        if not spec.accepts(spec.default):
            raise RetrofitError(f"{where}: its default {spec.default!r} is not {spec.expects} (its type hint)")
        specs.append(spec)
    return tuple(specs)


def check_schema(norm: str, schema: tuple[OptionSpec, ...], others: dict[str, tuple[OptionSpec, ...]]) -> None:
    """Refuse, in one line, an option named like a patch key or declared with another type by a norm in `others`
    (name -> schema): one flag, one record field and one recipe key take one type."""
    for spec in schema:
        if spec.name in PATCH_KEYS:
            raise RetrofitError(f"norm {norm!r} option {spec.name!r} is also a key of the patch itself (flag "
                                f"--{spec.name.replace('_', '-')}, patch.{spec.name}): give the option another name")
        for other, theirs in sorted(others.items()):
            clash = next((o for o in theirs if o.name == spec.name and set(o.kinds) != set(spec.kinds)), None)
            if clash is not None:
                raise RetrofitError(f"norm {norm!r} option {spec.name!r} is {'|'.join(spec.kinds)} but norm {other!r} "
                                    f"declares it {'|'.join(clash.kinds)}: one name takes one type (one flag, one "
                                    "recipe key); give one of them another name")


__all__ = ["KINDS", "PATCH_KEYS", "OptionSpec", "check_schema", "option_schema"]
