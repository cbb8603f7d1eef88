"""The attention seam: retrofit's two attention functions, registered with transformers, and what runs in them.

transformers calls `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)(module, q, k, v, mask,
...)`. We register two attention functions — `retrofit` (wrapping sdpa) and `retrofit_eager` (wrapping the model's
eager function) — each with the matching mask function under the same name (without it transformers passes no mask
at all: padding and KV-cache masks would be silently lost). Each call dispatches to the norm module attached to the
attention module as its `retrofit` child (norms/attention_call.py: `kernel_call` -> kernels); a module without one
runs the wrapped function unchanged, so a config object shared with an unpatched model cannot change that model.
observer.py hooks the same seam to see every call's query, key and value (diagnose, calibrate); patching.py attaches
the norms; attention_modules.py finds the modules a patch targets.
"""

from __future__ import annotations

import sys

from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .errors import RetrofitError
from .gate import GATE_INPUT, gated
from .norms.base import CHILD

# While `observe` (observer.py) is active, each observed attention module holds its observer under this attribute
# (removed on exit): the model carries its own observers, so two models (or threads on two models) never see each
# other's.
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


__all__ = ["BASE_OF", "CHILD", "IMPLEMENTATIONS", "OBSERVER", "eager_attention_of", "retrofit_attention",
           "retrofit_eager_attention"]
