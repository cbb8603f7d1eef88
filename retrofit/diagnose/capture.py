"""Capture attention through the patcher's seam, a few query rows at a time.

    with capture_rows(model, positions, on_layer):
        model(input_ids=ids, use_cache=False)          # on_layer(LayerRows) once per layer, in order

`retrofit.observe` (observer.py) hands us each layer's query/key/value as the forward runs (no eager
rewrite, patched or not). We rebuild the weights of the chosen query rows only — (B, H, R, T), never
the T x T matrix — with the layer's own normalization, call `on_layer`, and drop them, so memory
stays bounded by one layer's rows. Why rows suffice: the models are causal, so the row at position
L-1 of a long window is exactly the last row of a length-L forward on the same prefix, for every
norm here (each works per query row, SSMax counting the row's visible keys).

Each norm rebuilds its own weights from the logits l = q.k * scaling (`Norm.weights` in its file; what the output
sees, `head_out`, is always produced by the norm module itself), for example:

    softmax / none   a = softmax(l)
    avnorm           a = softmax(l)  (weights untouched; the head output is normalized afterwards)
    psoftmax         a = exp(l) / ||exp(l)||_p
    ssmax            a = softmax(f(n) l),  n = keys the row sees (Norm.logit_factor)
    softmax1         a = exp(l) / (exp(b_h) + sum exp(l)),  b_h the sink logit
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention_modules import attention_modules
from ..attention_seam import IMPLEMENTATIONS, eager_attention_of
from ..errors import RetrofitError
from ..norms import baseline_norm
from ..observer import observe
from . import measures


@dataclass
class LayerRows:
    """One layer's attention for the chosen query rows. B windows, H query heads, R rows, T keys."""

    layer: int
    norm: str                   # the norm's name; "softmax" for an unpatched model
    positions: torch.Tensor     # (R,) query positions; row r sees keys 0..positions[r]
    logits: torch.Tensor        # (B, H, R, T) q.k * scaling, -inf on hidden keys (before the norm's own map)
    weights: torch.Tensor       # (B, H, R, T) attention weights, 0 on hidden keys
    visible: torch.Tensor       # (B, H, R, T) bool
    values: torch.Tensor        # (B, H, T, D) value vectors, repeated over the query heads that share them
    q_norm: torch.Tensor        # (B, H, R) ||q|| of each row
    k_norm: torch.Tensor        # (B, H, T) ||k|| of each key
    head_out_raw: torch.Tensor  # (B, H, R, D) weights @ values
    head_out: torch.Tensor      # (B, H, R, D) what the output projection sees (after AVNorm, for instance)
    n: torch.Tensor             # (B, H, R, 1) number of keys each row sees
    weight_fn: Callable         # weight_fn(logits, temperature, n) -> weights: the norm's map at temperature T
    logit_factor: torch.Tensor  # (B, H, R, 1) factor the norm applies to l (SSMax: s_h log n; else 1)
    scaling: float              # the logit scale 1/T of Eq. (2): l = q.k * scaling
    kv_heads: int               # value vectors are shared by H / kv_heads query heads (GQA)
    p: float = 1.0              # p of p-softmax
    sink: torch.Tensor | None = None  # (H, 1) sink logit of softmax+1


def weight_map(norm) -> tuple[str, Callable, float, torch.Tensor | None]:
    """(name, weight_fn(logits, T, n), p, sink (H, 1) or None) for a retrofit norm or None (the model's own softmax).

    The norm says how it makes its weights (Norm.weights, Norm.bound_terms): no norm is named here. Temperature
    divides every logit the norm sees, the softmax+1 sink logit included (the classic sink b = 0 is unchanged)."""
    if norm is None:
        return baseline_norm(), lambda s_, t, n: measures.softmax_weights(s_ / t), 1.0, None
    p, sink = norm.bound_terms()
    return norm.name, lambda s_, t, n: norm.weights(s_, n, t), p, sink


def _visible_rows(attention_mask, positions, batch: int, kv_len: int) -> torch.Tensor:
    """(B, 1, R, T) bool: causal (key <= position) and whatever the model's own mask hides."""
    keys = torch.arange(kv_len, device=positions.device)
    visible = (keys[None, :] <= positions[:, None])[None, None]            # (1, 1, R, T)
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise RetrofitError(f"diagnose expects a 4-D attention mask, got shape {tuple(attention_mask.shape)}")
        rows = attention_mask[:, :, positions, :kv_len]
        allowed = rows if rows.dtype == torch.bool else rows > torch.finfo(rows.dtype).min / 2
        visible = visible & allowed[:, :1]
    return visible.expand(batch, 1, -1, -1)


def _base_kernel(module, visible):
    """The kernel the patched model wraps, with our rows' mask in the form it takes: sdpa takes the
    bool mask; an eager function (a model patched over eager, e.g. for soft-capping) adds a float one."""
    if getattr(module.config, "_attn_implementation", "") == IMPLEMENTATIONS["eager"][0]:
        additive = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        return eager_attention_of(module), additive.masked_fill(~visible, torch.finfo(torch.float32).min)
    return sdpa_attention_forward, visible


def layer_rows(module, query, key, value, attention_mask, scaling, norm, positions) -> LayerRows:
    """Rebuild the weights of the rows at `positions` from one attention call (see the module docstring)."""
    B, H, T, D = query.shape
    if key.shape[2] != T:
        raise RetrofitError("diagnose runs full forwards without a KV cache (pass use_cache=False)")
    scaling = D ** -0.5 if scaling is None else float(scaling)
    rep = H // key.shape[1]
    k = key.float().repeat_interleave(rep, 1)                               # (B, H, T, D)
    v = value.float().repeat_interleave(rep, 1)
    q = query.float()[:, :, positions]                                      # (B, H, R, D)
    visible = _visible_rows(attention_mask, positions, B, T).expand(B, H, -1, -1)
    logits = (q @ k.transpose(-1, -2)) * scaling                            # (B, H, R, T)
    cap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    if cap:  # Gemma-2 soft-caps its logits before the softmax
        logits = cap * torch.tanh(logits / cap)
    logits = logits.masked_fill(~visible, -math.inf)
    name, fn, p, sink = weight_map(norm)  # fn(logits, temperature, n)
    n = visible.sum(-1, keepdim=True).float()                              # (B, H, R, 1)
    weights = fn(logits, 1.0, n)
    factor = norm.logit_factor(n) if norm is not None else None
    factor = torch.ones_like(n) if factor is None else factor.float()
    out_raw = weights @ v                                                   # (B, H, R, D)
    if norm is None:
        out = out_raw
    else:  # the norm itself makes what the output projection sees, on just these rows
        base, mask = _base_kernel(module, visible[:, :1])                   # mask (B, 1, R, T)
        if norm.acts_on_output:  # AVNorm: the wrapped kernel's output, normalized as the projection's hook does
            out, _ = base(module, query[:, :, positions], key, value, mask, scaling=scaling, dropout=0.0)
            out = norm(out)
        else:
            out, _ = norm(module, query[:, :, positions], key, value, mask, base=base, scaling=scaling, dropout=0.0)
        out = out.float().transpose(1, 2)                                   # (B, R, H, D) -> (B, H, R, D)
    return LayerRows(layer=int(module.layer_idx), norm=name, positions=positions, logits=logits,
                     weights=weights, visible=visible, values=v, q_norm=q.norm(dim=-1), k_norm=k.norm(dim=-1),
                     head_out_raw=out_raw, head_out=out, n=n, weight_fn=fn, logit_factor=factor, scaling=scaling,
                     kv_heads=key.shape[1], p=p, sink=sink)


def capture_rows(model, positions, on_layer: Callable[[LayerRows], None]):
    """Context manager: while active, each attention call of `model` builds LayerRows for `positions`
    and hands them to `on_layer`. Raises RetrofitError for a model whose attention retrofit cannot see."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    if getattr(model, "config", None) is None or not attention_modules(model):
        raise RetrofitError(f"{type(model).__name__} has no attention module retrofit can observe "
                            "(it needs a transformers model whose attention goes through the attention registry)")

    @torch.no_grad()
    def fn(module, query, key, value, attention_mask, scaling, norm):
        on_layer(layer_rows(module, query, key, value, attention_mask, scaling, norm,
                            positions.to(query.device)))

    return observe(model, fn)
