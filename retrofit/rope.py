"""RoPE extension as a patch option: transformers' own `config.rope_parameters`, rotary module(s) rebuilt.

    import retrofit
    retrofit.patch(model, "softmax", rope="yarn:4")                          # the training-free baseline
    retrofit.patch(model, "avnorm", rope={"rope_type": "dynamic", "factor": 4})
    retrofit.unpatch(model)                  # the original rotary module(s) and config values, bitwise

String grammar (`parse_rope`): ``TYPE:FACTOR[,KEY=VALUE]...``, e.g. ``linear:4``, ``dynamic:2``, ``yarn:4``,
``yarn:4,original=8192,beta_fast=32``, ``llama3:8,low_freq_factor=1,high_freq_factor=4``. KEY is any key
transformers' validator accepts for TYPE (ROPE_KEYS); ``original`` is short for
``original_max_position_embeddings``; VALUE is a number or true/false. longrope needs two lists
(short_factor, long_factor): pass it as a dict.

What a patch does (transformers 5.23, modeling_rope_utils.py):
- `config.rope_parameters` becomes {rope_type, factor, the type's keys, rope_theta and partial_rotary_factor
  kept}; yarn, longrope and llama3 also get `original_max_position_embeddings` = L (default: the model's
  `max_position_embeddings`), as `standardize_rope_params` would fill it.
- `max_position_embeddings` becomes int(factor * L) — except for dynamic, where transformers reads
  `max_position_embeddings` as the length at which NTK scaling starts (`_compute_dynamic_ntk_parameters`):
  raising it would postpone the extension, so dynamic leaves it at L.
- Each rotary module whose config is the model's is rebuilt from the new config (`type(m)(config)`); the
  original is kept aside on the new one, so `restore_rope` puts back the very same object.
- Models with RoPE per layer type (Gemma 3: `rope_parameters = {"sliding_attention": .., "full_attention": ..}`)
  get the extension on `full_attention` only, as Gemma 3's own 128K checkpoints do: local layers see at most
  their window, so their relative positions never leave the trained range.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping

from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .bounds import MOST, check_size
from .errors import RetrofitError, closest
from .families import family_of
from .record import read_record, write_record

# The keys transformers' `_validate_<type>_rope_parameters` accepts (required, optional), minus rope_type.
# original_max_position_embeddings is filled in when absent; partial_rotary_factor is carried over.
ROPE_KEYS: dict[str, tuple[set, set]] = {
    "linear": ({"factor"}, {"rope_theta"}),
    "dynamic": ({"factor"}, {"rope_theta"}),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "rope_theta", "attention_factor", "beta_fast",
                          "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"factor", "short_factor", "long_factor"},
                 {"original_max_position_embeddings", "rope_theta", "attention_factor"}),
    # transformers has no defaults for the llama3 keys (its validator requires them; Llama 3.1 used 1 and 4)
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor"}, {"original_max_position_embeddings", "rope_theta"}),
}
USES_ORIGINAL = {"yarn", "longrope", "llama3"}  # types whose init function reads original_max_position_embeddings
# types whose init function also returns an attention factor != 1: the rotary module multiplies cos and sin by it, so
# q.k, the logits, are scaled by its square at every position (YaRN x4: 1.1386^2 = 1.296)
SCALES_LOGITS = {"yarn", "longrope"}
ALIASES = {"original": "original_max_position_embeddings", "type": "rope_type"}
EXTENDED_LAYER_TYPE = "full_attention"
ORIGINAL_ATTR = "_retrofit_original"  # on a rebuilt rotary module: [the original module] (a list hides it)


def parse_rope(text: str) -> dict:
    """'yarn:4,original=8192' -> {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 8192}."""
    head, *pairs = [part.strip() for part in str(text).split(",")]
    rope_type, sep, factor = head.partition(":")
    if not sep or not factor:
        raise RetrofitError(f"rope {text!r} has no factor: write TYPE:FACTOR[,KEY=VALUE...], e.g. yarn:4")
    spec = {"rope_type": rope_type.strip().lower(), "factor": _number(factor, "factor")}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise RetrofitError(f"rope {text!r}: {pair!r} is not KEY=VALUE")
        key = ALIASES.get(key.strip(), key.strip())
        spec[key] = _value(value.strip(), key)
    return spec


def _number(text: str, key: str):
    try:
        value = float(text)
    except ValueError:
        raise RetrofitError(f"rope {key} must be a number, got {text!r}") from None
    return int(value) if key == "original_max_position_embeddings" and value.is_integer() else value


def _value(text: str, key: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return _number(text, key)


def normalize_rope(spec) -> dict:
    """A validated copy of a rope spec (string or dict): known type and keys, numeric factor >= 1."""
    spec = parse_rope(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, dict):
        raise RetrofitError(f"rope must be a string like 'yarn:4' or a dict, got {type(spec).__name__}")
    spec = {ALIASES.get(k, k): copy.deepcopy(v) for k, v in spec.items()}
    rope_type = spec.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in ROPE_KEYS:  # a list: unhashable, a TypeError (issue 61)
        raise RetrofitError(f"unknown rope type {rope_type!r}{closest(rope_type, ROPE_KEYS)}; "
                            f"retrofit knows: {', '.join(ROPE_KEYS)}")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        import transformers
        raise RetrofitError(f"rope type {rope_type!r} is missing from the installed transformers "
                            f"{transformers.__version__}; upgrade transformers or pick another type")
    required, optional = ROPE_KEYS[rope_type]
    valid = required | optional
    for key in spec:
        if key != "rope_type" and key not in valid:
            raise RetrofitError(f"rope type {rope_type!r} has no key {key!r}{closest(key, valid)}; "
                                f"its keys: {', '.join(sorted(valid))}")
    factor = spec.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise RetrofitError(f"rope factor must be a number >= 1, got {factor!r}")
    if factor < 1:
        raise RetrofitError(f"rope factor must be >= 1 (it is the context extension), got {factor!r}")
    check_size(factor, "rope factor", MOST["rope_factor"])  # yarn:1e308 would overflow int(factor * positions)
    for key, value in spec.items():
        _check_value(rope_type, key, value)
    missing = sorted(required - spec.keys())
    if missing:
        how = "pass a dict with both lists (head_dim/2 numbers each)" if rope_type == "longrope" else \
            f"e.g. {rope_type}:{factor:g}," + ",".join(f"{k}=..." for k in missing)
        raise RetrofitError(f"rope type {rope_type!r} needs {' and '.join(missing)}: {how}")
    spec["factor"] = float(factor)
    return spec


def _check_value(rope_type: str, key: str, value) -> None:
    """transformers' validators only warn about a bad value; the init function would then fail mid-patch."""
    if key in ("rope_type", "factor", "short_factor", "long_factor"):  # factor and lists are checked apart
        return
    if key == "truncate":
        ok = isinstance(value, bool)
    elif key == "original_max_position_embeddings":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 2
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        want = {"truncate": "true or false", "original_max_position_embeddings": "an integer >= 2"}.get(key, "a number")
        raise RetrofitError(f"rope {rope_type} {key} must be {want}, got {value!r}")


def describe_rope(record) -> str:
    """'yarn x4 (orig 8192)' for a rope record, a spec, config.retrofit or a string; 'none' for None."""
    if record is None:
        return "none"
    if isinstance(record, dict) and "norm" in record:  # the whole config.retrofit
        return describe_rope(record.get("rope"))
    if isinstance(record, dict) and "parameters" in record:
        spec, original = record["parameters"], record.get("original_positions")
    else:
        spec, original = normalize_rope(record), None
    original = spec.get("original_max_position_embeddings", original)
    text = f"{spec['rope_type']} x{spec['factor']:g}"
    return f"{text} (orig {original})" if original else text


# ---- the model side --------------------------------------------------------------------------------

def rope_config(model: nn.Module):
    """The config the rotary modules read (the text config of a multimodal model)."""
    return model.config.get_text_config()


def rotary_modules(model: nn.Module, config) -> list[tuple[str, nn.Module]]:
    """Rotary embedding modules built from `config`, as transformers writes them (inv_freq buffers)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__.endswith("RotaryEmbedding") and getattr(m, "config", None) is config
            and any(b == "inv_freq" or b.endswith("_inv_freq") for b, _ in m.named_buffers(recurse=False))]


def _layer_types(config) -> list[str] | None:
    """None for one global rope_parameters dict; the layer types to extend for nested ones."""
    nested = config.nested_rope_parameter_keys(config.rope_parameters or {})
    if not nested:
        return None
    if EXTENDED_LAYER_TYPE not in nested:
        raise RetrofitError(f"{config.model_type} has RoPE per layer type ({', '.join(nested)}) but none named "
                            f"{EXTENDED_LAYER_TYPE!r}; retrofit does not know which to extend")
    return [EXTENDED_LAYER_TYPE]


def plan_rope(model: nn.Module, spec) -> dict:
    """Check that `spec` can extend this model's RoPE and return the record `apply_rope` will carry out.
    Changes nothing, so `patch` can refuse before it touches the model."""
    spec = normalize_rope(spec)
    config = rope_config(model)
    family = family_of(config)
    if family is not None and family.positions == "learned":
        raise RetrofitError(f"{config.model_type} has learned absolute positions ({family.positions_path}), not "
                            "RoPE: rope cannot extend them; use nope=True to remove positions instead")
    if not rotary_modules(model, config):
        raise RetrofitError(f"found no rotary embedding in {type(model).__name__} (looked for *RotaryEmbedding "
                            "modules with inv_freq): rope applies to RoPE models only")
    layer_types = _layer_types(config)
    for params in _current_in(config.rope_parameters or {}, layer_types):
        if params.get("rope_type", "default") != "default":
            raise RetrofitError(f"{config.model_type} already extends RoPE (rope_type {params['rope_type']!r}, factor "
                                f"{params.get('factor')}); retrofit's rope option starts from plain RoPE")
    original = spec.get("original_max_position_embeddings") or config.max_position_embeddings
    if spec["rope_type"] in USES_ORIGINAL:
        spec["original_max_position_embeddings"] = int(original)
    _check_longrope_lengths(spec, config)
    new_max = config.max_position_embeddings if spec["rope_type"] == "dynamic" else int(spec["factor"] * original)
    saved = {"max_position_embeddings": config.max_position_embeddings,
             "rope_parameters": copy.deepcopy(config.rope_parameters)}
    if spec["rope_type"] in USES_ORIGINAL and hasattr(config, "original_max_position_embeddings"):
        # Phi-3 keeps L at the top level and standardize_rope_params copies it over ours: keep the two equal
        saved["original_max_position_embeddings"] = config.original_max_position_embeddings
    record = {"parameters": spec, "layer_types": layer_types, "original": saved,
              "max_position_embeddings": new_max, "original_positions": int(original)}
    _check_reloadable(config, record)
    return record


def compose_temperature(plan: dict, owner: str | None) -> str | None:
    """Let one correction own the logits' temperature. Under a norm that sets it itself (`owner`, e.g. "ssmax":
    Norm.owns_temperature), a YaRN or LongRoPE extension gets attention_factor 1, so its factor does not multiply
    the norm's (SSMax-beyond on YaRN x4 at 16K would be 1.077 x 1.296); recorded in the plan as
    `temperature_owner`. An attention_factor the user gave is kept (what the user typed wins), and said.
    Returns the PatchReport's note, or None when nothing composes."""
    spec = plan["parameters"]
    if owner is None or spec["rope_type"] not in SCALES_LOGITS:
        return None
    if spec.get("attention_factor") == 1.0:  # given as 1 (or a reloaded record): the norm owns it all the same
        plan["temperature_owner"] = owner
        return None
    if "attention_factor" in spec:
        return (f"rope {describe_rope(plan)} keeps the attention_factor {spec['attention_factor']:g} given, on top of "
                f"{owner}'s own temperature: both scale the logits")
    spec["attention_factor"] = 1.0
    plan["temperature_owner"] = owner
    return (f"rope {spec['rope_type']}'s attention factor set to 1: {owner} owns the logits' temperature (give "
            "attention_factor= in the rope to stack both)")


def _check_longrope_lengths(spec: dict, config) -> None:
    if spec["rope_type"] != "longrope":
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = (config.rope_parameters or {})
    want = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    for key in ("short_factor", "long_factor"):
        value = spec[key]
        if not (isinstance(value, list) and len(value) == want and all(isinstance(x, (int, float)) for x in value)):
            raise RetrofitError(f"longrope {key} must be a list of {want} numbers (rotary dim / 2), got {value!r}")


def _new_values(config, record: dict) -> dict:
    """The config attributes `apply_rope` sets: rope_parameters (with theta etc. carried over) and lengths."""
    spec = record["parameters"]
    params = copy.deepcopy(config.rope_parameters)
    for current in _current_in(params, record["layer_types"]):
        keep = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
        current.clear()
        current.update({**keep, **copy.deepcopy(spec)})
    values = {"rope_parameters": params, "max_position_embeddings": record["max_position_embeddings"]}
    if "original_max_position_embeddings" in record["original"]:
        values["original_max_position_embeddings"] = record["original_positions"]
    return values


def _current_in(params: dict, layer_types) -> list[dict]:
    return [params] if layer_types is None else [params[t] for t in layer_types]


def _check_reloadable(config, record: dict) -> None:
    """A saved checkpoint must load: build the config class from the patched values, as from_pretrained will.
    Phi3Config.validate_rope accepts only default/longrope and rewrites 'yarn' to 'longrope' on load."""
    values = _new_values(config, record)
    try:
        reloaded = type(config).from_dict({**config.to_dict(), **copy.deepcopy(values)})
    except Exception as err:  # transformers raises ValueError, KeyError or its strict-dataclass error
        reason = str(err).strip().splitlines()[-1].strip()
        raise RetrofitError(f"{type(config).__name__} refuses rope {describe_rope(record)}: {reason}") from None
    got = _current_in(reloaded.rope_parameters, record["layer_types"])
    if any(p.get("rope_type") != record["parameters"]["rope_type"] for p in got):
        raise RetrofitError(f"{type(config).__name__} rewrites rope type {record['parameters']['rope_type']!r} "
                            f"to {got[0].get('rope_type')!r} when loading; this model cannot keep it")


def extend_rope(model: nn.Module, spec: str | Mapping, *, temperature_owner: str | None = None) -> dict:
    """Add a RoPE extension to a model retrofit patched without one, keeping its norm and trained parameters: e.g.
    an arm finetuned at 512 tokens with AVNorm, evaluated with dynamic NTK x4 beyond its 8192 positions (dynamic
    NTK is the original RoPE inside them, so inside they are the arm itself). Recorded, so unpatch restores it.
    temperature_owner: the patched norm's name when it owns the logits' temperature (compose_temperature);
    retrofit.extend_rope (patching.extend_rope) fills it in from the model's own patch."""
    record = read_record(model) if hasattr(model, "config") else None
    if record is None:
        raise RetrofitError("extend_rope adds a RoPE extension to a patched model; patch an unpatched one with "
                            "retrofit.patch(model, 'softmax', rope=...)")
    if record.get("rope"):
        raise RetrofitError(f"this model already extends RoPE ({describe_rope(record)}): evaluate it as it is")
    if record.get("nope"):
        raise RetrofitError("this model was patched with nope: its rotary embedding is removed, there is none to "
                            "extend")
    plan = plan_rope(model, spec)
    compose_temperature(plan, temperature_owner)
    apply_rope(model, plan)
    write_record(model, rope=plan)
    return plan


def apply_rope(model: nn.Module, record: dict) -> list[str]:
    """Set the config values of a `plan_rope` record and rebuild the rotary modules; returns their names."""
    config = rope_config(model)
    for key, value in _new_values(config, record).items():
        setattr(config, key, value)
    try:
        return _rebuild(model, config, keep_original=True)
    except Exception:  # leave the model as it was: originals back, config values back
        restore_rope(model, record)
        raise


def _rebuild(model: nn.Module, config, keep_original: bool) -> list[str]:
    names = []
    for name, old in rotary_modules(model, config):
        anchor = next(iter(old.buffers()))
        try:
            new = type(old)(config)
        except Exception as err:
            raise RetrofitError(f"cannot rebuild {type(old).__name__} from its config: {err}") from None
        new.to(anchor.device)  # inv_freq as the constructor computes it (fp32), on the model's device
        new.train(old.training)
        if keep_original:
            setattr(new, ORIGINAL_ATTR, [old])
        _set(model, name, new)
        names.append(name)
    return names


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, module)


def restore_rope(model: nn.Module, record: dict | None) -> int:
    """Put back the original rotary modules and config values; returns how many modules."""
    restored = 0
    for name, module in list(model.named_modules()):
        original = getattr(module, ORIGINAL_ATTR, None)
        if original:
            _set(model, name, original[0])
            restored += 1
    if record:
        _put_original_values(rope_config(model), record)
    return restored


def _put_original_values(config, record: dict) -> None:
    for key, value in record["original"].items():
        setattr(config, key, copy.deepcopy(value))


@contextlib.contextmanager
def original_rope(model: nn.Module, record: dict):
    """While active, the rotary modules and config values the model had before `record`'s extension (a
    distillation teacher's positions); the extended ones come back after, the very same objects."""
    extended = [(name, m) for name, m in model.named_modules() if getattr(m, ORIGINAL_ATTR, None)]
    config = rope_config(model)
    values = {key: getattr(config, key) for key in record["original"]}
    for name, module in extended:
        _set(model, name, getattr(module, ORIGINAL_ATTR)[0])
    _put_original_values(config, record)
    try:
        yield model
    finally:
        for name, module in extended:
            _set(model, name, module)
        for key, value in values.items():
            setattr(config, key, value)


def reset_to_original(model: nn.Module, record: dict) -> None:
    """For a model loaded from a checkpoint saved with rope applied (its config.json carries the extended
    values): go back to the original values and rotary modules, so that re-applying the patch keeps the
    true originals aside and `unpatch` restores them."""
    config = rope_config(model)
    _put_original_values(config, record)
    _rebuild(model, config, keep_original=False)


__all__ = ["ROPE_KEYS", "apply_rope", "compose_temperature", "describe_rope", "normalize_rope", "original_rope",
           "parse_rope", "plan_rope", "reset_to_original", "restore_rope", "rotary_modules"]
