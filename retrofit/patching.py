"""The public patching API: attach a norm to a Hugging Face causal LM's attention, and take it off again.

    import retrofit
    report = retrofit.patch(model, "avnorm", kind="rms")   # a PatchReport: print(report) shows what was patched
    retrofit.patch(model, "softmax", rope="yarn:4")         # RoPE extension composes with every norm (rope.py)
    retrofit.unpatch(model)                                  # exactly the original model again
    retrofit.patch(model, PatchSpec.parse("avnorm:layers=16-29"))  # one value for the patch (patch_spec.py)

`patch` checks the model, attaches one norm module per selected attention module as its `retrofit` child and
switches a kernel norm's model to one of the attention functions attention_seam.py registers with transformers
(an output norm hooks the output projection instead). No class is rewritten or reassigned. The patch is recorded
as plain JSON in `config.retrofit`, which `retrofit.from_pretrained` reads to rebuild it. `rope=` sets
transformers' own `config.rope_parameters` and rebuilds the rotary module(s), keeping the originals aside (rope.py).
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Mapping, Sequence

from torch import nn

from .attention_modules import attention_modules
from .attention_seam import BASE_OF, IMPLEMENTATIONS
from .errors import RetrofitError
from .families import (
    FAMILIES,
    OUTPUT_PROJECTIONS,
    family_of,
    layers_without_positions,
    output_projection,
    position_query_scaling,
)
from .gate import OutputGate, describe_gate, drop_gate_hook, pass_gate_input
from .norms import AttentionShape, get_norm
from .norms.base import CHILD
from .norms.output_hook import drop_output_hooks, hook_output
from .patch_spec import PatchSpec
from .positions import already_without_positions, has_positions_removed, remove_positions, restore_positions
from .record import (
    FORMAT,
    GATED_FORMAT,
    SELECTIVE_FORMAT,
    PatchReport,
    PushWarning,
    drop_record,
    read_record,
    write_record,
)
from .rope import apply_rope, compose_temperature, describe_rope, plan_rope, reset_to_original, restore_rope
from .rope import extend_rope as _extend_rope
from .selection import select


def is_patched(model: nn.Module) -> bool:
    return any(CHILD in m._modules for m in model.modules()) or has_positions_removed(model)


def _shape(module: nn.Module, config, positions: int | None = None) -> AttentionShape:
    """positions: the model's original max positions (before a rope extension); default the config's."""
    positions = positions or getattr(config, "max_position_embeddings", None)
    heads = getattr(config, "num_attention_heads", None) or module.num_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None) or config.hidden_size // heads
    return AttentionShape(int(heads), int(kv_heads), int(head_dim), positions)


def _implementations(model: nn.Module, acts_on_output: bool) -> tuple[str, str | None]:
    """(the implementation the model runs now and unpatch restores, the one of ours a kernel norm wraps).

    A norm that acts on the heads' outputs (AVNorm) works over any implementation and wraps none. A kernel norm
    (p-softmax, SSMax, softmax+1) runs retrofit's own kernels: over sdpa, or eager where the model has no sdpa
    path; a model loaded with flash or flex attention runs them instead (unpatch puts its implementation back).
    Paged attention and Hub kernels are refused for those: their callers pass state our kernels cannot use.
    Ours on an unpatched model (built from a patched model's config object) means its base."""
    current = model.config._attn_implementation
    restore = BASE_OF.get(current, current)
    if acts_on_output:
        return restore, None
    instead = "'sdpa' (or 'eager')" if getattr(model, "_supports_sdpa", True) else "'eager'"
    if restore.startswith("paged|") or "/" in restore:
        what = "paged attention (continuous batching)" if restore.startswith("paged|") else "a Hub kernel"
        raise RetrofitError(f"cannot run this norm's kernels over {what}: load the model with attn_implementation="
                            f"{instead} (avnorm works over any implementation)")
    wrap = restore if restore in IMPLEMENTATIONS else "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
    try:  # transformers' own check: e.g. gpt_oss has no sdpa path (its sinks live in its eager function)
        model.get_correct_attn_implementation(wrap)
    except (ValueError, ImportError):
        raise RetrofitError(f"{type(model).__name__} does not support attention implementation {wrap!r}; load it "
                            f"with attn_implementation={instead}") from None
    return restore, wrap


def _guarded_switch(model: nn.Module, attn_implementation, *args, **kwargs):
    """set_attn_implementation of a model patched with a kernel norm: a switch to sdpa or eager keeps the patch
    (it moves to our function over the new base); anything else would silently drop it, so it is refused.

    Bound on the instance because transformers 5.23 offers no seam for it: PreTrainedModel.set_attn_implementation
    writes config._attn_implementation_internal directly (past the config's property setter) after
    _check_and_adjust_attn_implementation, which validates the name only; no hook, callback or per-instance
    validator is consulted. unpatch removes the binding."""
    cls_switch = type(model).set_attn_implementation
    if isinstance(attn_implementation, str) and attn_implementation in IMPLEMENTATIONS:
        write_record(model, base_attn_implementation=attn_implementation)
        return cls_switch(model, IMPLEMENTATIONS[attn_implementation][0], *args, **kwargs)
    if isinstance(attn_implementation, str) and attn_implementation in BASE_OF:
        return cls_switch(model, attn_implementation, *args, **kwargs)
    raise RetrofitError(f"this model is patched with {read_record(model)['norm']}, which runs retrofit's "
                        f"kernels; switching to {attn_implementation!r} would drop the patch: use sdpa or eager, or "
                        "retrofit.unpatch(model) first")


def _check_patchable(model: nn.Module, nope: bool, acts_on_output: bool) -> tuple[str, str | None]:
    """Refuse what we cannot patch faithfully; returns _implementations(model, acts_on_output)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise RetrofitError(f"{type(model).__name__} is not a Hugging Face model (it has no config)")
    if is_patched(model):
        raise RetrofitError("this model is already patched; call retrofit.unpatch(model) first")
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise RetrofitError(f"{type(model).__name__} does not route attention through transformers' "
                            "attention registry, so retrofit cannot patch it")
    restore, wrap = _implementations(model, acts_on_output)
    family = family_of(config)
    bypass = family.eager_bypass if family is not None else None  # a config flag that skips the registry under eager
    if wrap == "eager" and bypass is not None and getattr(config, bypass, False):
        raise RetrofitError(f"{config.model_type} with {bypass}=True under eager bypasses the attention registry; "
                            f"load it with attn_implementation='sdpa' or set {bypass}=False")
    if nope and family is None:
        raise RetrofitError(f"nope needs to know where {config.model_type!r} adds positions, and it is not in "
                            f"retrofit's table ({', '.join(FAMILIES)}); add a row to retrofit/families.py")
    return restore, wrap


def _detach_config(model: nn.Module) -> str | None:
    """An unpatched model whose config names our implementation was built from a patched model's config object
    (transformers' from_config does not copy it): give it its own copy, or patching and unpatching this model
    would rewrite the other's record and switch the other back to its base. Returns the report's note."""
    if model.config._attn_implementation not in BASE_OF:
        return None
    memo: dict = {}
    config = copy.deepcopy(model.config, memo)
    for module in model.modules():  # every module holding the config (or one of its sub-configs) gets the copy's
        if id(getattr(module, "config", None)) in memo:
            module.config = memo[id(module.config)]
    drop_record(config)  # the other model's record
    model.config = config
    return "config copied: it was shared with a patched model (built from its config)"


def has_sinks(module: nn.Module) -> bool:
    """Learned per-head sink logits of the model's own (gpt_oss's `sinks`, passed to attention as s_aux)."""
    return isinstance(getattr(module, "sinks", None), nn.Parameter)


def _check_sinks(norm_cls, opts, config, modules) -> str | None:
    """Refuse a norm that would drop or double the model's learned sinks; returns the report's note."""
    if not any(has_sinks(m) for _, m in modules):
        return None
    refusal = norm_cls.sink_refusal(opts)
    if refusal:
        raise RetrofitError(f"{config.model_type} has learned attention sinks: {refusal}")
    return f"the model's learned attention sinks are {norm_cls.sink_note(opts)}"


def _check_query_scaling(norm: str, norm_cls, opts, config) -> str | None:
    """Refuse scaling queries by position twice unless stack=True; returns the report's note."""
    already = position_query_scaling(config) if norm_cls.scales_queries_by_position else None
    if not already:
        return None
    if not norm_cls.stacks_query_scaling(opts):
        raise RetrofitError(f"{config.model_type} already applies {already}; {norm} would scale its queries a "
                            f"second time: pass stack=True to stack them anyway")
    return f"{norm} stacked on the model's own {already}"


def _attach(modules, norm_cls, opts, gate, heads, config, positions: int | None) -> int:
    """One norm module (with its gate) as each selected attention module's `retrofit` child; returns the parameters
    added. heads: the selected query heads (None: all); positions: the model's max positions before a rope
    extension."""
    params_added = 0
    for _, module in modules:
        ref = next(module.parameters(), None)
        shape = _shape(module, config, positions)
        child = norm_cls(opts, shape)
        child.select_heads(heads)
        if gate is not None:  # in the norm module: saved, reloaded, trained and unpatched with it
            child.add_module("gate", OutputGate(gate, shape.num_heads, shape.head_dim, config.hidden_size))
            module.register_forward_pre_hook(pass_gate_input, with_kwargs=True)
        if ref is not None:
            child.to(device=ref.device, dtype=ref.dtype)
        module.add_module(CHILD, child)
        if child.acts_on_output and gate is None:
            if output_projection(module) is None:
                raise RetrofitError(f"{type(module).__name__} has no output projection retrofit knows (looked for "
                                    f"{', '.join(OUTPUT_PROJECTIONS)}); add its name to families.OUTPUT_PROJECTIONS")
            hook_output(module)
        params_added += sum(p.numel() for p in child.parameters())
    return params_added


def _switch_implementation(model: nn.Module, base: str, wrap: str | None) -> str | None:
    """A kernel norm: our attention function over the wrapped base, kept across a switch (_guarded_switch); an output
    norm: the model's own base again. Returns the report's note."""
    if wrap is not None:  # a kernel norm: our function over the wrapped base; a switch keeps it (_guarded_switch)
        model.set_attn_implementation(IMPLEMENTATIONS[wrap][0])
        model.set_attn_implementation = types.MethodType(_guarded_switch, model)
        if wrap != base:
            return f"{base} replaced by retrofit's kernels over {wrap} while patched (unpatch restores it)"
    elif model.config._attn_implementation != base:  # ours, from a shared config object: the model's own base
        model.set_attn_implementation(base)
    return None


def patch(model: nn.Module, norm: str | PatchSpec | None = None, *, nope: bool = False,
          rope: str | Mapping | None = None, layers: str | Sequence[int] | None = None,
          heads: str | Sequence[int] | None = None, gate: str | Mapping | None = None, **options) -> PatchReport:
    """Attach `norm` to every self-attention module of `model` (in place) and return a PatchReport.
    norm: a name (its options as keywords) or a PatchSpec (then nothing else); required (no default: uncalibrated
    AVNorm ruins a pretrained model, 3.91 -> 14.29 on SmolLM2).
    rope: extend RoPE, as 'yarn:4' or {'rope_type': 'yarn', 'factor': 4, ...} (see retrofit.rope); it applies to
    the whole model. layers / heads: patch only these attention modules, and (avnorm, ssmax, softmax1) only these
    query heads ('16-29', ':4', [16, 17]; retrofit.selection); the others keep the original attention, bitwise.
    gate: each head's output times a sigmoid gate from the layer input ('head', 'head:0.5:12'; retrofit.gate)."""
    spec = PatchSpec.of(norm, nope=nope, rope=rope, layers=layers, heads=heads, gate=gate, **options)
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: patch the model (see unpatch)
    norm, nope, norm_cls, opts, gate = spec.norm, spec.nope, get_norm(spec.norm), spec.norm_options, spec.gate
    base, wrap = _check_patchable(model, nope, norm_cls.on_output(opts) and gate is None)  # gated: ours, always
    notes = [_check_query_scaling(norm, norm_cls, opts, model.config)]
    notes.append(_detach_config(model))
    rope_plan = plan_rope(model, spec.rope) if spec.rope is not None else None  # refuses before any change
    if rope_plan is not None:  # SSMax under YaRN: one of the two owns the logits' temperature, not both
        notes.append(compose_temperature(rope_plan, norm if norm_cls.owns_temperature(opts) else None))
    modules = attention_modules(model)
    if not modules:
        family = family_of(model.config)
        tried = family.attention if family else "modules named *Attention with a layer_idx"
        raise RetrofitError(f"found no attention module to patch in {type(model).__name__} (looked for {tried})")
    config = model.config
    modules, layers, heads = select(modules, spec.layers, spec.heads, _shape(modules[0][1], config).num_heads)
    notes.append(_check_sinks(norm_cls, opts, config, modules))
    if not nope and layers_without_positions(config):
        notes.append(already_without_positions(config))
    params_added = _attach(modules, norm_cls, opts, gate, heads, config,
                           rope_plan and rope_plan["original_positions"])
    positions = remove_positions(model, family_of(config)) if nope else None
    if rope_plan is not None:
        apply_rope(model, rope_plan)
    notes.append(_switch_implementation(model, base, wrap))
    if hasattr(type(model), "push_to_hub"):  # transformers' push: warned in one line (see PushWarning)
        model.push_to_hub = PushWarning(model)
    drop_record(model)  # a fresh record (a stale one may ride in a config loaded from a checkpoint)
    write_record(model, norm=norm, options=dataclasses.asdict(opts), nope=nope, base_attn_implementation=base,
                 calibration=None, rope=rope_plan, layers=layers, heads=heads, gate=gate,  # older retrofits refuse
                 format=GATED_FORMAT if gate else SELECTIVE_FORMAT if layers or heads else 1)  # what they would drop
    hidden, calibrated = norm_cls.report_options(dataclasses.asdict(opts))
    return PatchReport(
        model_type=config.model_type, norm=norm, options=dataclasses.asdict(opts), nope=nope,
        hidden_options=hidden, calibrated=calibrated,
        modules=[name for name, _ in modules], base_attn_implementation=base, positions=positions,
        params_added=params_added, layers=layers, heads=heads, layer_count=len(attention_modules(model)),
        family="table" if family_of(config) else "generic", rope=describe_rope(rope_plan) if rope_plan else None,
        notes=[note for note in notes if note], gate=describe_gate(gate) if gate else None,
    )


def unpatch(model: nn.Module) -> None:
    """Remove every norm module and restore positions and the attention implementation, in place; of a torch.compile
    wrapper, of its model (writes through the wrapper land on the wrapper; Dynamo recompiles after the change)."""
    model = getattr(model, "_orig_mod", model)
    if not is_patched(model):
        raise RetrofitError("this model is not patched; there is nothing to unpatch")
    for module in model.modules():
        module._modules.pop(CHILD, None)
        drop_output_hooks(module)  # acts_on_output norms' hooks, and their mark for torch.compile
        drop_gate_hook(module)
    model.__dict__.pop("set_attn_implementation", None)  # the class's own again (see _guarded_switch)
    model.__dict__.pop("push_to_hub", None)  # PushWarning
    restore_positions(model)
    record = read_record(model) or {}
    restore_rope(model, record.get("rope"))
    base = record.get("base_attn_implementation") or BASE_OF.get(model.config._attn_implementation, "sdpa")
    model.set_attn_implementation(base)
    drop_record(model)


def unpatch_parameter_free(model: nn.Module, source: str, nope: bool) -> str | None:
    """Take out the patch of a checkpoint retrofit patched with a patch that has no parameters (softmax, ssmax
    scale=beyond, a RoPE extension: e.g. an experiment's control arm), so another patch can replace it: it is its
    finetuned weights under a function of them. Returns what was replaced, one line (None: `model` was unpatched).
    One with trained patch parameters (gains, exponents, sinks) is refused: replacing would drop them; so is one
    trained without positions when the new patch (`nope` False) would give them back."""
    if not is_patched(model):
        return None
    record = read_record(model) or {}
    trained = sum(p.numel() for m in model.modules() if CHILD in m._modules for p in m._modules[CHILD].parameters())
    if trained:
        raise RetrofitError(f"{source} is already patched with {record.get('norm')} and carries {trained} trained "
                            "patch parameters that a new patch would drop: patch its unpatched base instead")
    if record.get("nope") and not nope:
        raise RetrofitError(f"{source} was trained without positions (nope); a patch without --nope would give them "
                            "back to weights that never saw them: add --nope")
    rope = record.get("rope")
    unpatch(model)
    return (f"replaced {source}'s own patch ({record.get('norm')}" + (f", rope {describe_rope(record)}" if rope else "")
            + ", no parameters): the weights are the checkpoint's, the patch is the one above")


def patch_record(model: nn.Module) -> dict | None:
    """The recorded patch (config.retrofit) of a patched model, else None."""
    record = read_record(model) if hasattr(model, "config") else None
    return record if record is not None and is_patched(model) else None


def extend_rope(model: nn.Module, spec: str | Mapping) -> dict:
    """retrofit.extend_rope: rope.extend_rope on a patched model, with its norm's say over the logits' temperature
    (SSMax under YaRN: YaRN's attention factor 1; rope.compose_temperature). Returns the rope record."""
    record = patch_record(model) or {}
    norm_cls = get_norm(record["norm"]) if record.get("norm") else None
    owner = record["norm"] if norm_cls is not None and norm_cls.owns_temperature(record.get("options")) else None
    return _extend_rope(model, spec, temperature_owner=owner)


def patch_from_record(model: nn.Module, record: dict) -> PatchReport:
    """Re-apply a patch recorded in config.retrofit (used when loading a saved checkpoint)."""
    if isinstance(record, dict) and record.get("format", FORMAT) > FORMAT:
        raise RetrofitError(f"this checkpoint was written by a newer retrofit (format {record['format']}); "
                            "upgrade retrofit")
    spec = PatchSpec.from_record(record)
    if record.get("rope"):  # config.json carries the extended values: start from the recorded originals
        reset_to_original(model, record["rope"])
    report = patch(model, spec)
    write_record(model, calibration=record.get("calibration"))
    report.calibration = record.get("calibration")
    return report



__all__ = ["CHILD", "FORMAT", "PatchReport", "PushWarning", "extend_rope", "has_sinks", "is_patched", "patch",
           "patch_from_record",
           "patch_record", "unpatch", "unpatch_parameter_free"]
