"""What vLLM may serve of a patched checkpoint: its `config.retrofit` record -> a ServePlan, or a one-line refusal.

    plan = serve_plan(config)        # a transformers config (vLLM's hf_config) or the config.json dict
    plan.norm, plan.options, plan.layers, plan.heads, plan.nope, plan.original_positions

Decided here, before vLLM builds a module, so nothing is ever served as something else:
- the norm: as its `Norm.serve_as` says, one of SERVE_STEPS (retrofit/serve/llama.py runs each), unless its
  `Norm.serve_refusal` says why not (p-softmax: vLLM's attention returns no log-sum-exp); a norm without serve_as is
  refused. Which norm is served how is said in the norm's file only (docs/serving.md has the table for people).
- "sinks" where the attention backend takes sinks; otherwise refused (SINKS_REFUSED, at build time: llama.py).
- RoPE extensions (yarn, linear, llama3): config.json already carries the extended `rope_parameters`, which vLLM's
  own rope reads. dynamic and longrope: refused (vLLM computes them differently: ROPE_REFUSED).
- A model family outside ARCHITECTURES: refused.
- an output gate (retrofit.gate), with any norm: refused (GATE_REFUSED).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import RetrofitError, quoted
from ..families import FAMILIES
from ..load.validate import SIZE_LIMIT, check_record
from ..norms import available_norms, get_norm, make_options
from ..record import GUARD_KEY, GUARDS, read_record

# The architectures (config.json) whose vLLM model code the plugin extends (retrofit.serve.llama), and those retrofit
# patches that it does not serve yet -> vLLM's (module, class): both read from families.py's rows (Family.vllm). The
# plugin registers a guard for each guarded one (retrofit.serve.guards): vLLM's own model, which refuses a patched
# checkpoint in one line instead of serving it as the original. Other architectures are vLLM's, unguarded.
ARCHITECTURES = tuple(f.vllm.architecture for f in FAMILIES.values() if f.vllm is not None and f.vllm.served)
GUARDED = {f.vllm.architecture: (f"vllm.model_executor.models.{f.vllm.module}", f.vllm.architecture)
           for f in FAMILIES.values() if f.vllm is not None and not f.vllm.served}
# What retrofit/serve/llama.py does with a norm inside vLLM's attention, by Norm.serve_as (base.py says what each is).
SERVE_STEPS = ("plain", "queries", "outputs", "sinks")
SINKS_REFUSED = ("{norm} is not served by this vLLM build: its attention backend ({backend}) takes no attention "
                 "sinks; run it with retrofit.from_pretrained or `retrofit eval`, or serve on a backend with sinks")
GATE_REFUSED = ("its output gate is not served by vLLM: the gate reads each attention layer's input, which vLLM's "
                "attention layer does not hand retrofit's module; run it with retrofit.from_pretrained or `retrofit "
                "eval`")
# RoPE types vLLM's get_rope builds from rope_parameters as transformers does (tests/serve/test_serve_vllm.py: yarn,
# linear, llama3 within 1e-5), and the ones it builds differently, refused.
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
ROPE_REFUSED = {
    "dynamic": "vLLM's dynamic NTK fixes its base for the longest length; transformers' (retrofit's) rescales it "
               "to each sequence's length",
    "longrope": "vLLM's longrope gave other logits than transformers' (4.3 apart on a tiny Llama, its short factors)",
}


@dataclass(frozen=True)
class ServePlan:
    """The patch a vLLM model builds, read from a checkpoint's config.retrofit."""

    norm: str
    options: dict
    layers: tuple[int, ...] | None  # the patched attention modules (decoder layers); None = all
    heads: tuple[int, ...] | None  # the patched query heads; None = all
    nope: bool  # positions removed: no rotary embedding on q and k
    original_positions: int | None  # L for ssmax / avnorm mode=beyond: positions before a rope extension

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _get(config, key):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def serve_plan(config, where: str = "this checkpoint") -> ServePlan | None:
    """The ServePlan of a config with a retrofit record, None for a plain one; RetrofitError (one line) for a record
    vLLM cannot serve exactly."""
    record = config.get("retrofit") if isinstance(config, dict) else read_record(config)
    if record is None:
        return None
    try:
        check_record(record, where)
    except RetrofitError as err:  # the patch's own rules (PatchSpec) say what is wrong, not where: vLLM's log needs it
        text = str(err)
        raise RetrofitError(text if text.startswith(f"{where}: ") else f"{where}: {text}") from None
    architectures = _get(config, "architectures") or []
    unknown = [a for a in architectures if a not in ARCHITECTURES]
    if unknown or not architectures:
        raise RetrofitError(f"{where}: retrofit's vLLM plugin serves {', '.join(ARCHITECTURES)} checkpoints, not "
                            f"{', '.join(map(str, unknown or ['one without architectures']))}; run it with "
                            "retrofit.from_pretrained")
    norm, layers, heads = record["norm"], record.get("layers"), record.get("heads")
    _check_norm(norm, record.get("options") or {}, heads, where)
    if record.get("gate"):
        raise RetrofitError(f"{where}: {GATE_REFUSED}")
    rope = record.get("rope")
    original = _original_positions(config, rope, where)
    if rope:
        rope_type = rope["parameters"].get("rope_type")
        if rope_type not in ROPE_TYPES:
            why = ROPE_REFUSED.get(rope_type, "retrofit's vLLM plugin has not checked it")
            raise RetrofitError(f"{where}: rope {rope_type} is not served by vLLM: {why}; it serves "
                                f"{', '.join(ROPE_TYPES[1:])}, else run it with retrofit.from_pretrained")
    _check_selection(layers, _get(config, "num_hidden_layers"), "layers", "layer", where)
    _check_selection(heads, _get(config, "num_attention_heads"), "heads", "head", where)
    return ServePlan(norm=norm, options=dict(record.get("options") or {}),
                     layers=tuple(layers) if layers is not None else None,
                     heads=tuple(heads) if heads is not None else None,
                     nope=bool(record.get("nope")), original_positions=original)


def served_norms() -> list[str]:
    """The registered norms vLLM serves (those whose Norm.serve_as is a step the plugin runs)."""
    return [name for name in available_norms() if get_norm(name).serve_as in SERVE_STEPS]


def _check_norm(norm: str, options: dict, heads: list | None, where: str) -> None:
    """The norm serves as one of SERVE_STEPS with these options on these heads, or a one-line refusal (the norm's
    own, from Norm.serve_refusal, first). check_record has checked the options."""
    cls = get_norm(norm)
    why = cls.serve_refusal(make_options(norm, **options), heads)
    if why:
        raise RetrofitError(f"{where}: {why}")
    if cls.serve_as not in SERVE_STEPS:
        raise RetrofitError(f"{where}: retrofit's vLLM plugin serves {', '.join(served_norms())}, not {norm!r}; run "
                            "it with retrofit.from_pretrained")


def _check_selection(chosen: list | None, count, key: str, unit: str, where: str) -> None:
    """The recorded layer or head indices exist in the model, once each: vLLM would patch nothing at an index past
    them (or patch another head), silently. check_record has made them a list of indices >= 0."""
    if chosen is None:
        return
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise RetrofitError(f"{where}: retrofit.{key} selects {unit}s but config.json has no {unit} count to check "
                            "them against; save the checkpoint again")
    past = [i for i in chosen if i >= count]
    if past:
        raise RetrofitError(f"{where}: retrofit.{key} selects {unit} {past[0]} but the model has {count} {unit}s "
                            f"(0-{count - 1}); the record was not written for this model: save it again")
    twice = sorted({i for i in chosen if chosen.count(i) > 1})
    if twice:
        raise RetrofitError(f"{where}: retrofit.{key} names {unit} {twice[0]} twice; save the checkpoint again")


def _original_positions(config, rope: dict | None, where: str) -> int | None:
    """The positions the model was trained on: a rope extension records them; otherwise the config's. Either is a
    whole number in 1..SIZE_LIMIT or a one-line refusal here, before vLLM's loader builds a module from it (`"abc"`
    was a ValueError from int() inside vLLM's loader: issue 61)."""
    if rope and rope.get("original_positions") is not None:
        return _positions(rope["original_positions"], "retrofit.rope.original_positions", where)
    value = _get(config, "max_position_embeddings")
    return None if value is None else _positions(value, "max_position_embeddings", where)


def _positions(value, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SIZE_LIMIT:
        raise RetrofitError(f"{where}: {key} must be a whole number of positions in 1..{SIZE_LIMIT:,} (the context "
                            f"the model was trained on), got {quoted(value)}; save the checkpoint again")
    return value


def vllm_config_overrides(config: dict) -> dict:
    """hf_overrides for vLLM: the guard (config.json's attention implementation, which only retrofit's loader may
    pass) is dropped for vLLM's own config object; vLLM never builds a transformers model from it."""
    return {GUARD_KEY: None} if config.get(GUARD_KEY) in GUARDS else {}
