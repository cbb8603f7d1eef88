"""The patch's two records: `config.retrofit` (plain JSON that rebuilds the patch) and `PatchReport` (what one
`retrofit.patch` call did, for a person).

    write_record(model, norm="avnorm", options={...}, nope=False, base_attn_implementation="sdpa", rope=None)
    write_record(model, calibration=summary)          # one field of an existing record
    read_record(model)                                # the dict, or None when the config has none
    drop_record(model)                                # unpatch: the config is plain again

This module is the only writer of `config.retrofit` (patch, calibrate and the recovery schedule call it), so the
record's schema lives here: FIELDS, filled by `write_record` when it creates a record.

A config with a record also carries the guard `attn_implementation: GUARD`: an inert attribute on the live config
(transformers reads only `_attn_implementation`), but every `save_pretrained` writes it into config.json
(transformers' Trainer, a PEFT merge, retrofit's own saves and `retrofit push` all save through it), where
`PretrainedConfig.__init__` reads it as the attention implementation and `from_pretrained` / `pipeline` refuse the
never-registered name, quoting it: the name is a sentence that says what to do, so the refusal is in retrofit's
words even where retrofit is not installed. retrofit's loader passes the recorded base implementation explicitly,
which overrides it (docs/plain-transformers.md); so does `retrofit.enable()`'s (integrations/auto_classes.py).
`PushWarning` is the same guard on the live model's `push_to_hub`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from .errors import RetrofitError
from .version import VERSION

FORMAT = 3          # the newest version of the config.retrofit record this retrofit reads
SELECTIVE_FORMAT = 2  # a record with layers or heads (format 1 readers would patch every layer and head: refused)
GATED_FORMAT = 3    # a record with a gate (format 2 readers would rebuild the patch without it: refused)
# The record's schema: field -> value of a new record until a caller sets it. layers / heads: the selected
# attention-module and query-head indices (sorted ints, retrofit.selection), None = all.
# The guard (above): config.json's attention implementation in every saved patched model; never registered. No "/"
# (transformers would read "a/b" as a Hub kernel to fetch) and no "sdpa", "flash" or "flex" (its own checks).
GUARD_KEY = "attn_implementation"
GUARD = "retrofit checkpoint: load it with retrofit.from_pretrained(path), or call retrofit.enable() first"
# a standalone export's (retrofit push --standalone): it ships its own modeling file, loaded by explicit choice only
STANDALONE_GUARD = ("retrofit checkpoint with its own modeling_retrofit.py: read it, then load with "
                    "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True), or with "
                    "retrofit.from_pretrained(path)")
STANDALONE_FILE = "modeling_retrofit.py"  # what a standalone export's auto_map names (hub/standalone.py writes it)
GUARDS = (GUARD, STANDALONE_GUARD, "retrofit.from_pretrained")  # as retrofit writes them, and as older retrofits did
FIELDS = {"format": 1, "retrofit_version": VERSION, "norm": None, "options": {}, "nope": False,
          "base_attn_implementation": None, "calibration": None, "rope": None, "layers": None, "heads": None}
# Fields a record holds only when they are set (None removes them), so a record without them stays readable by the
# retrofit before them (which refuses a field it does not know). gate: the output gate (retrofit.gate: {kind, start,
# inputs}); a record with one has format GATED_FORMAT.
OPTIONAL_FIELDS = {"gate": None}


def _config(target):
    """A model's config, or the config itself (records live on configs; a model's sub-modules may hold its own)."""
    return getattr(target, "config", target)


def read_record(target) -> dict | None:
    """config.retrofit of a model (or a config) when it is a dict, else None. Not a copy: read, do not write."""
    record = getattr(_config(target), "retrofit", None)
    return record if isinstance(record, dict) else None


def write_record(target, **changes) -> dict:
    """Set `changes` in the record of a model (or a config), creating it from FIELDS when there is none.
    Unknown field names are refused: the schema is FIELDS and OPTIONAL_FIELDS (set to None: removed)."""
    unknown = sorted(set(changes) - set(FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise RetrofitError(f"config.retrofit has no field {', '.join(unknown)}; its fields: "
                            f"{', '.join([*FIELDS, *OPTIONAL_FIELDS])}")
    config = _config(target)
    record = read_record(config)
    if record is None:
        record = {name: (dict(value) if isinstance(value, dict) else value) for name, value in FIELDS.items()}
        config.retrofit = record
        setattr(config, GUARD_KEY, GUARD)
    record.update(changes)
    for name in OPTIONAL_FIELDS:
        if name in record and record[name] is None:
            del record[name]
    return record


def set_option(target, name: str, value) -> None:
    """One option of the recorded norm (a recovery schedule's final knob value)."""
    record = read_record(target)
    if record is None or not isinstance(record.get("options"), dict):
        raise RetrofitError("this config has no patch record with options to set")
    write_record(target, options={**record["options"], name: value})


def drop_record(target) -> None:
    """Remove config.retrofit and the guard (unpatch; a config copied from a patched model's; a config read from a
    saved checkpoint, where transformers has made the guard the attention implementation: back to its default)."""
    config = _config(target)
    if hasattr(config, "retrofit"):
        del config.retrofit
    drop_guard(config)


def drop_guard(target) -> None:
    """Remove the guard alone (the record stays): the attention implementation back to its default."""
    config = _config(target)
    if config.__dict__.get(GUARD_KEY) in GUARDS:
        del config.__dict__[GUARD_KEY]
    if getattr(config, "_attn_implementation", None) in GUARDS:
        config._attn_implementation = None


def standalone_auto_map(architecture: str) -> dict:
    """The auto_map of a standalone export of a model of transformers class `architecture`."""
    return {"AutoModelForCausalLM": f"{STANDALONE_FILE.removesuffix('.py')}.Retrofit{architecture}"}


def is_standalone_export(config) -> bool:
    """Whether a config (config.json's mapping, or a config object) is a standalone export's: a patch record and an
    auto_map naming only the export's own class for the model's one transformers architecture. retrofit loads such
    a folder from its record, with trust_remote_code=False; it never runs the modeling file."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    architectures = get("architectures") or []
    return isinstance(get("retrofit"), dict) and len(architectures) == 1 and \
        get("auto_map") == standalone_auto_map(architectures[0])


def describe_selection(indices: list[int] | None, count: int | None = None) -> str:
    """[16, 17, ..., 29] -> '16-29'; [0, 4, 8] -> '0,4,8' (ranges compressed; readable by parse_selection)."""
    if indices is None:
        return "all"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return text if count is None else f"{text} ({len(indices)} of {count})"


@dataclass
class PatchReport:
    """What `patch` did. `str()` is the table `retrofit patch` prints, `repr()` one line, `as_dict()` for JSON;
    a notebook shows `_repr_markdown_`."""

    model_type: str
    norm: str
    options: dict
    nope: bool
    modules: list[str]
    params_added: int
    base_attn_implementation: str
    positions: str | None = None
    family: str = "table"
    calibration: dict | None = None
    notes: list[str] = field(default_factory=list)
    rope: str | None = None  # describe_rope of the RoPE extension, e.g. "yarn x4 (orig 8192)"
    layers: list[int] | None = None  # the selected attention modules' indices (None: all)
    heads: list[int] | None = None  # the selected query heads per patched layer (None: all)
    layer_count: int | None = None  # attention modules in the model (patched or not)
    hidden_options: list[str] = field(default_factory=list)  # left out of the table (Norm.report_options)
    calibrated: str | None = None  # the option shown with its calibration ("gain"), from Norm.report_options
    gate: str | None = None  # retrofit.gate.describe_gate of the output gate, e.g. "head, 1 at start (identity), ..."

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _rows(self) -> list[tuple[str, str]]:
        shown = {k: v for k, v in self.options.items() if k not in self.hidden_options}
        opts = ", ".join(f"{k}={v}" for k, v in shown.items()) or "no options"
        if self.calibrated:
            what = self.calibrated
            opts += f", {what} " + (f"calibrated on {self.calibration['tokens']} tokens" if self.calibration
                                    else f"{self.options.get(what, 1.0)} (not calibrated)")
        rows = [
            ("model type", f"{self.model_type} ({'in retrofit table' if self.family == 'table' else 'generic'})"),
            ("norm", f"{self.norm} ({opts})"),
            ("attention modules", f"{len(self.modules)}{self._of_layers()} patched over "
                                  f"{self.base_attn_implementation}"),
            ("parameters added", f"{self.params_added:,}"),
            ("positions", f"{self.positions if self.nope else 'kept'}"),
        ] + ([("heads", f"{describe_selection(self.heads)} only (the others unchanged)")] if self.heads else []) \
            + ([("rope", self.rope)] if self.rope else []) + ([("gate", self.gate)] if self.gate else [])
        return rows + [("note", n) for n in self.notes]

    def _of_layers(self) -> str:
        if self.layers is None:
            return ""
        return f" of {self.layer_count} (layers {describe_selection(self.layers)})"

    def __str__(self) -> str:
        return "\n".join(f"{name:<17} {value}" for name, value in self._rows())

    def __repr__(self) -> str:
        extras = "".join(f", {what}" for what in ("nope" if self.nope else "", self.rope and f"rope {self.rope}",
                                                   self.calibration and "calibrated",
                                                   self.layers and f"layers {describe_selection(self.layers)}",
                                                   self.heads and f"heads {describe_selection(self.heads)}",
                                                   self.gate and "gated") if what)
        return (f"<PatchReport {self.norm} on {self.model_type}: {len(self.modules)} attention modules over "
                f"{self.base_attn_implementation}, {self.params_added:,} parameters added{extras}>")

    def _repr_markdown_(self) -> str:
        lines = ["| retrofit patch | |", "|---|---|"]
        return "\n".join(lines + [f"| {name} | {str(value).replace('|', '&#124;')} |" for name, value in self._rows()])


PUSH_WARNING = ("this model is patched by retrofit: transformers' push_to_hub publishes it without retrofit's checks "
                "and model card; save_pretrained it and run `retrofit push FOLDER --repo ID` instead")


class PushWarning:
    """`model.push_to_hub` of a patched model: warns (one line, PUSH_WARNING), then runs transformers' own push.

    An instance attribute set by patch and removed by unpatch: the class is never touched, so other models are
    unaffected. Warned, not routed to retrofit's publish: that works from a saved folder or run (hub/, above patch
    in the data flow), and a plain push of a model the user holds is still theirs to make. A small class rather
    than a bound function, so a patched model still pickles and deep-copies (the copy's push warns for the copy)."""

    def __init__(self, model):  # a transformers PreTrainedModel
        self.model = model

    def __call__(self, *args, **kwargs):
        warnings.warn(PUSH_WARNING, UserWarning, stacklevel=2)
        return type(self.model).push_to_hub(self.model, *args, **kwargs)
