"""One rule for damaged inputs: what a model folder says about itself is checked before anything is
built from it, and what was loaded is checked before anything runs.

    check_raw_config(folder, where)      # a folder's config.json as written: sizes, dtype
    with config_errors(where): config = AutoConfig.from_pretrained(...)   # its own validation, one line
    check_config(config, where)          # config.json's sizes, heads, dtype, RoPE factor
    check_record(record, where)          # config.retrofit against record.FIELDS, with types
    check_loaded_keys(source, info)      # no weight missing, extra or misshapen (retrofit/patch_tensors.py)
    check_finite(tensors, source)        # the patch's saved parameters: no NaN or inf (retrofit/patch_tensors.py)

Each refusal is one line naming the file, the key and what is allowed. A plain folder and a retrofit checkpoint
go through the same checks: a missing weight would otherwise be left at its random initialization, silently.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging as hf_logging

from ..bounds import check_heads, key_name
from ..errors import RetrofitError, quoted
from ..norms import available_norms, get_norm
from ..patch_spec import PatchSpec
from ..record import FIELDS, FORMAT, OPTIONAL_FIELDS

# Sizes and counts config.json may hold (transformers' names; GPT-2's n_head etc. map onto them): each an integer
# in [1, SIZE_LIMIT]. 2**24 is above every released model's vocabulary (262,144) and context (Llama 4: 10M);
# a learned position table of 10**12 rows would be allocated before anything else could refuse it.
SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
         "intermediate_size", "head_dim", "max_position_embeddings")
SIZE_LIMIT = 2**24
# The attention implementations a recorded patch may name as its base: transformers' built-in ones. Never a Hub
# kernel ("org/kernel" would be fetched and run) nor paged attention (our kernels cannot use its state).
BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


# The same sizes under the names config.json files use (GPT-2's n_head, n_embd, ...), checked in the raw JSON
# before transformers reads it (its config classes divide by the head count: 0 heads is a ZeroDivisionError).
RAW_SIZES = SIZES + ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "n_ctx")
DTYPE_KEYS = ("dtype", "torch_dtype")


def _size_error(where: str, key: str, value) -> RetrofitError:
    return RetrofitError(f"{where}: {key} must be an integer in 1..{SIZE_LIMIT:,}, got {quoted(value)}")


def _is_size(value) -> bool:
    return _is(int, value) and 1 <= value <= SIZE_LIMIT


def _is_float_dtype(name) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype) and getattr(torch, name).is_floating_point


def check_raw_config(folder, where: str) -> None:
    """A folder's config.json as written, before transformers builds a config from it: sizes and dtype."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # absent or not JSON: check_model_files and the loader name those
    if not isinstance(raw, dict):
        return
    for key in RAW_SIZES:
        if raw.get(key) is not None and not _is_size(raw[key]):
            raise _size_error(where, key, raw[key])
    for key in DTYPE_KEYS:
        value = raw.get(key)
        if value is not None and value != "auto" and not (isinstance(value, str) and _is_float_dtype(value)):
            raise RetrofitError(f"{where}: {key} must be a torch floating-point type (float32, bfloat16, float16, "
                                f"...), got {quoted(value)}")


@contextlib.contextmanager
def config_errors(where: str):
    """AutoConfig's own validation errors (transformers 5's strict dataclasses: hidden_size "32"; a YaRN
    rope_parameters without its factor) as one line naming `where`."""
    try:
        yield
    except (StrictDataclassError, KeyError, TypeError, ArithmeticError, AttributeError) as err:
        reason = " ".join(str(err).strip(" '\"").split())[:240]
        raise RetrofitError(f"{where} is not a valid config ({reason}); fix that value") from None


def check_config(config, where: str) -> None:
    """Sizes, head counts, dtype and RoPE factor of a model config, before any module is built from it."""
    for key in SIZES:
        value = getattr(config, key, None)
        if value is None:
            continue
        if not _is_size(value):
            raise _size_error(where, key_name(config, key), value)
    check_heads(config, where)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str) and dtype != "auto" and not _is_float_dtype(dtype):
        raise RetrofitError(f"{where}: dtype must be a torch floating-point type (float32, bfloat16, float16, ...), "
                            f"got {quoted(dtype)}")
    rope = getattr(config, "rope_parameters", None)
    factor = rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type", "default") != "default" else None
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not math.isfinite(factor) or not 1 <= factor <= SIZE_LIMIT):
        raise RetrofitError(f"{where}: rope_parameters.factor must be a number in 1..{SIZE_LIMIT:,} (the context "
                            f"extension), got {quoted(factor)}")


def _is(kind, value) -> bool:
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def _indices(value) -> bool:
    return value is None or (isinstance(value, list) and all(_is(int, i) and i >= 0 for i in value))


# config.retrofit's fields (record.FIELDS) -> (test, what the field must be)
RECORD_TYPES = {
    "format": (lambda v: _is(int, v) and v >= 1, "an integer >= 1"),
    "retrofit_version": (lambda v: v is None or isinstance(v, str), "a string"),
    "norm": (lambda v: isinstance(v, str) and v in available_norms(), f"one of {', '.join(available_norms())}"),
    "options": (lambda v: isinstance(v, dict), "a mapping of the norm's options"),
    "nope": (lambda v: isinstance(v, bool), "true or false (a JSON boolean, not a string)"),
    "base_attn_implementation": (lambda v: v is None or v in BASE_IMPLEMENTATIONS,
                                 f"one of {', '.join(BASE_IMPLEMENTATIONS)}"),
    "calibration": (lambda v: v is None or isinstance(v, dict), "null or a mapping"),
    "rope": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("parameters"), dict)),
             "null or a mapping with 'parameters'"),
    "layers": (_indices, "null or a list of indices >= 0"),
    "heads": (_indices, "null or a list of indices >= 0"),
    "gate": (lambda v: v is None or isinstance(v, dict), "null or a mapping {kind, start, inputs}"),
}
assert RECORD_TYPES.keys() == FIELDS.keys() | OPTIONAL_FIELDS.keys(), "every record field has a type"


def check_record(record: dict, where: str) -> None:
    """config.retrofit against its schema: every field of its type, nothing else, the options those of the norm with
    the types its option schema declares (Norm.option_schema, from the type hints: a string is never read as a bool
    or a number, and an option declared `str | float` takes either)."""
    if _is(int, record.get("format")) and record["format"] > FORMAT:  # its fields may be new: say so first
        raise RetrofitError(f"{where}: this checkpoint was written by a newer retrofit (format {record['format']}); "
                            "upgrade retrofit")
    unknown = sorted(set(record) - set(FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise RetrofitError(f"{where}: retrofit has no field {', '.join(map(quoted, unknown))}; its fields: "
                            f"{', '.join([*FIELDS, *OPTIONAL_FIELDS])}")
    for key, value in record.items():
        test, what = RECORD_TYPES[key]
        if not test(value):
            raise RetrofitError(f"{where}: retrofit.{key} must be {what}, got {quoted(value)}")
    schema = {o.name: o for o in get_norm(record["norm"]).option_schema()}
    for key, value in record.get("options", {}).items():  # unknown keys: PatchSpec names the closest valid one below
        if key in schema and not schema[key].accepts(value):
            raise RetrofitError(f"{where}: retrofit.options.{key} must be {schema[key].expects}, got {quoted(value)}")
    PatchSpec.from_record(record)  # the patch's rules; the options' ranges and unknown keys in the norm's own words


@contextlib.contextmanager
def quiet_peft():
    """PEFT wrapping a model reads transformers' deprecated `is_gradient_checkpointing` (peft_model.py), whose
    FutureWarning every LoRA run and adapter load printed: nothing a retrofit user can act on. Only that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def quiet_transformers():
    """No loading report and no progress bar: check_loaded_keys reports what is wrong, in one line (a report or a
    bar drawn before it would make a refusal many lines)."""
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
