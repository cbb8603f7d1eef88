"""How a norm calls retrofit's kernels from inside transformers' attention call, exactly as sdpa_attention_forward
would run it: the visible keys (a static cache's unused tail dropped, causality decided as transformers decides it),
the mask, the model's learned sinks and transformers' position bias.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RetrofitError
from ..kernels.masks import hides_future

# How transformers' models hand an attention function their learned per-head sink logits (gpt_oss: s_aux=self.sinks).
SINK_KWARGS = ("s_aux", "sinks")


def visible_keys(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, is_causal: bool | None):
    """Translate what transformers hands an attention function into (key, value, mask, causal).

    Returns the keys/values to attend over, a mask (bool: True = attend, or additive float) of shape
    broadcastable to (B, H, Tq, Tk) or None, and `causal`: when True every key after a query's
    bottom-right position is hidden (queries are the last Tq of the Tk positions); with a mask, only
    when the mask hides them already, so it changes nothing but lets the kernels skip work. This mirrors transformers'
    `sdpa_attention_forward` exactly: a None mask means "causal" only when Tq > 1, and a None mask with
    Tk > Tq (prefill into an empty static cache) means only the first Tq keys are real.
    """
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None:
        # a decoder's padding mask already hides the future: saying so lets the kernels skip those blocks.
        # Asked of the mask transformers built once per forward (not of a fresh slice), so every layer
        # after the first gets the cached answer.
        hides = causal and hides_future(attention_mask, q_len, kv_len)
        if attention_mask.dim() == 4:
            attention_mask = attention_mask[:, :, :, :kv_len]
        return key, value, attention_mask, hides
    if not causal or q_len == 1:
        return key, value, None, False
    if kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    return key, value, None, True


def with_position_bias(position_bias: torch.Tensor | None, mask: torch.Tensor | None, causal: bool,
                       query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """`mask` (visible_keys') with transformers' `position_bias` (B, H, Tq, Tk), which sdpa_attention_forward adds to
    the logits (transformers 5.24: Inkling's relative position bias arrives so), folded in as its
    create_position_bias_mask does: the bias where a query may attend, key dtype's min elsewhere (a bool mask or
    causality), or the bias plus an additive float mask. `causal` stays as it was: the folded mask hides what it hid."""
    if position_bias is None:
        return mask
    bias = position_bias[..., : key.shape[2]]  # the keys visible_keys kept (an empty static cache's prefill: Tq)
    hidden = torch.finfo(key.dtype).min
    if mask is None and causal:
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=key.device).tril(kv_len - q_len)  # (Tq, Tk)
    if mask is None:
        return bias.contiguous()
    return (torch.where(mask, bias, hidden) if mask.dtype == torch.bool else bias + mask).contiguous()


def model_sink(kwargs: dict) -> torch.Tensor | None:
    """Pop the model's learned per-head sink logits (H,) from an attention call's kwargs; None if it has none."""
    found = [kwargs.pop(name) for name in SINK_KWARGS if kwargs.get(name) is not None]
    return found[0] if found else None


def kernel_call(kernel, module, query, key, value, attention_mask, *extra, scaling=None, dropout=0.0,
                is_causal=None, softcap=None, position_bias=None, **kwargs):
    """Run one of retrofit.kernels' attention functions in a transformers attention function's place.

    Returns (out (B, Tq, H, D), None) as transformers expects. `dropout` is the attention-weight
    dropout transformers passes (its models pass 0 outside training); applied only in training mode.
    `softcap` (Gemma 2's attn_logit_softcapping) caps the scaled logits, c * tanh(s / c), inside the
    kernel. `sliding_window` (in kwargs) needs nothing here: transformers builds the window into the
    mask it passes (measured on transformers 5.23 under sdpa: a bool mask on sliding layers whenever the
    window is shorter than the keys, None only when it hides nothing), and the kernels follow the mask.
    `position_bias` (transformers 5.24) is added to the logits, folded into the mask as sdpa does (with_position_bias).
    """
    if any(kwargs.get(name) is not None for name in SINK_KWARGS):  # patch() refuses first; never drop them silently
        raise RetrofitError(f"{type(module).__name__} passes learned attention sinks that this norm would drop")
    key, value, mask, causal = visible_keys(module, query, key, value, attention_mask, is_causal)
    mask = with_position_bias(position_bias, mask, causal, query, key)
    out = kernel(query, key, value, *extra, scale=scaling, causal=causal, attn_mask=mask,
                 enable_gqa=key.shape[1] != query.shape[1], softcap=softcap,
                 dropout_p=dropout if module.training else 0.0)  # (B, H, Tq, D)
    return out.transpose(1, 2).contiguous(), None
