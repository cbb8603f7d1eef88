"""The attention seam: retrofit's two attention functions, registered with transformers, and what runs in them.

transformers calls `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)(module, q, k, v, mask,
...)`. We register two attention functions — `retrofit` (wrapping sdpa) and `retrofit_eager` (wrapping the model's
eager function) — each with the matching mask function under the same name (without it transformers passes no mask
at all: padding and KV-cache masks would be silently lost). Each call dispatches to the norm module attached to the
attention module as its `retrofit` child (norms/attention_call.py: `kernel_call` -> kernels); a module without one
runs the wrapped function unchanged, so a config object shared with an unpatched model cannot change that model.
`observe` hooks the same seam to see every call's query, key and value (diagnose, calibrate). patching.py attaches
the norms.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .errors import RetrofitError
from .families import family_of
from .gate import GATE_INPUT, gated
from .norms.base import CHILD

# While `observe` is active, each observed attention module holds its observer under this attribute (removed on
# exit): the model carries its own observers, so two models (or threads on two models) never see each other's.
OBSERVER = "_retrofit_observer"


def eager_attention_of(module: nn.Module):
    """The model file's own eager attention function (GQA repeat, soft-capping etc. live there)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RetrofitError(f"{type(module).__name__} has no eager_attention_forward; load it with sdpa")
    return fn


def _dispatch(base, module, query, key, value, attention_mask, **kwargs):
    gate_input = kwargs.pop(GATE_INPUT, None)  # a gated module's input (retrofit.gate.pass_gate_input)
    observer = module.__dict__.get(OBSERVER)
    norm = module._modules.get(CHILD)
    if observer is not None:
        observer(module, query, key, value, attention_mask, kwargs.get("scaling"), norm)
    if norm is None or norm.acts_on_output and getattr(norm, "gate", None) is None:  # AVNorm: at the projection
        return base(module, query, key, value, attention_mask, **kwargs)
    if norm.acts_on_output:  # gated: the heads' outputs normalized here, before the gate
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        out = norm.keep_unselected(norm(out), out)
    elif getattr(norm, "head_mask", None) is not None:  # heads=: the unselected heads are the wrapped kernel's, bitwise
        out, _ = norm(module, query, key, value, attention_mask, base=base, **kwargs)
        original, weights = base(module, query, key, value, attention_mask, **kwargs)
        out, weights = norm.keep_unselected(out, original), None
    else:
        out, weights = norm(module, query, key, value, attention_mask, base=base, **kwargs)
    return gated(norm, out, gate_input), weights


def retrofit_attention(module, query, key, value, attention_mask, **kwargs):
    return _dispatch(sdpa_attention_forward, module, query, key, value, attention_mask, **kwargs)


def retrofit_eager_attention(module, query, key, value, attention_mask, **kwargs):
    return _dispatch(eager_attention_of(module), module, query, key, value, attention_mask, **kwargs)


# Base implementation -> (our registered name, attention function, mask function of the base).
# Names avoid "sdpa"/"flex_attention", which trigger transformers' own compatibility checks.
IMPLEMENTATIONS = {
    "sdpa": ("retrofit", retrofit_attention, sdpa_mask),
    "eager": ("retrofit_eager", retrofit_eager_attention, eager_mask),
}
BASE_OF = {name: base for base, (name, _, _) in IMPLEMENTATIONS.items()}
for _name, _fn, _mask in IMPLEMENTATIONS.values():
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, _mask)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The self-attention modules a patch targets, by the family table or, failing that, by shape."""
    family = family_of(model.config)
    if family is not None:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ == family.attention]
    # Generic: self-attention modules as transformers writes them (a layer index and the config).
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "config")]


def check_unsharded(modules, what: str) -> None:
    """Refuse reading or writing patch parameters outside a forward when they are sharded: under DeepSpeed
    ZeRO-3 a parameter holds an empty local shard (it has `ds_id`), under FSDP2 a DTensor shard."""
    for module in modules:
        for name, param in module.named_parameters():
            if hasattr(param, "ds_id") or type(param).__name__ == "DTensor":
                raise RetrofitError(f"{what} reads the patch's parameters outside a forward, but they are sharded "
                                    f"(DeepSpeed ZeRO-3 or FSDP: {name}); {what} before sharding — retrofit train "
                                    "calibrates before accelerate.prepare — or on the gathered model")


@contextlib.contextmanager
def observe(model: nn.Module, fn: Callable[..., None]) -> Iterator[None]:
    """While active, every attention call of `model` first calls
    fn(module, query, key, value, attention_mask, scaling, norm) — query (B, H, Tq, D) after RoPE,
    key/value (B, Hkv, Tk, D), norm the module's retrofit norm or None — then proceeds unchanged.
    Works on unpatched models too (their implementation is switched to ours for the duration)."""
    modules = [m for _, m in attention_modules(model)]
    if not modules:
        raise RetrofitError(f"found no attention module to observe in {type(model).__name__}")
    check_unsharded([m._modules[CHILD] for m in modules if CHILD in m._modules], "observe")
    switched = None
    if model.config._attn_implementation not in BASE_OF:
        switched = model.config._attn_implementation
        if switched not in IMPLEMENTATIONS:
            raise RetrofitError(f"cannot observe attention implementation {switched!r}; load with sdpa or eager")
        model.set_attn_implementation(IMPLEMENTATIONS[switched][0])
    for m in modules:
        m.__dict__[OBSERVER] = fn  # plain instance attribute: not a parameter, buffer or child
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop(OBSERVER, None)
        if switched is not None:
            model.set_attn_implementation(switched)


__all__ = ["BASE_OF", "CHILD", "IMPLEMENTATIONS", "OBSERVER", "attention_modules", "check_unsharded",
           "eager_attention_of", "observe", "retrofit_attention", "retrofit_eager_attention"]
