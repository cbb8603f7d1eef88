"""`observe`: every attention call of a model seen as it runs — its query, key, value, mask and norm — through
retrofit's attention seam (attention_seam.py), patched or not.

    with observe(model, lambda module, q, k, v, mask, scaling, norm: seen.append(q.shape)):
        model(input_ids)

diagnose (diagnose/capture.py), calibration and the recovery probes read attention this way; nothing is copied into
the model, and the observer leaves with the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from .attention_modules import attention_modules, check_unsharded
from .attention_seam import BASE_OF, CHILD, IMPLEMENTATIONS, OBSERVER
from .errors import RetrofitError


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
