"""Attention kernels for the norms that change the weights: p-softmax, Scalable-Softmax, softmax+1.

All take SDPA's conventions: q (B, H, Tq, D), k/v (B, Hkv, Tk, D); `causal` aligns bottom-right
(queries are the last Tq positions, as with a KV cache); `attn_mask` is bool (True = attend) or
additive float, broadcastable to (B, H, Tq, Tk). Rows with no visible key give 0.
"""

from __future__ import annotations

import math

import torch

from .masks import causal_mask, combine_causal, visible_counts


def _expand(q, k, v, enable_gqa):
    if k.shape[1] != q.shape[1]:
        if not enable_gqa:
            raise ValueError("q and k have different head counts: pass enable_gqa=True")
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return k, v


def _logits(q, k, scale, causal, attn_mask):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    allowed = torch.ones_like(s, dtype=torch.bool)
    if causal:
        allowed = allowed & causal_mask(q.shape[2], k.shape[2], q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.float()
            allowed = allowed & (attn_mask > torch.finfo(attn_mask.dtype).min / 2)
    return s.masked_fill(~allowed, float("-inf")), allowed


def psoftmax_attention(q, k, v, p=2.0, *, scale=None, causal=True, attn_mask=None, enable_gqa=False):
    """weights = exp(s) / ||exp(s)||_p over the visible keys (p=1: softmax)."""
    k, v = _expand(q, k, v, enable_gqa)
    s, allowed = _logits(q, k, scale, causal, attn_mask)
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    e = torch.exp(s - m)
    w = e / e.pow(p).sum(-1, keepdim=True).pow(1.0 / p).clamp_min(1e-30)
    return (w @ v.float()).to(q.dtype)


def ssmax_attention(q, k, v, s_param, *, scale=None, causal=True, attn_mask=None, enable_gqa=False):
    """Scalable-Softmax: logits times s_h * log(n), n = keys visible to that query."""
    n = visible_counts(attn_mask, causal, q.shape[2], k.shape[2], q.device)
    factor = s_param.float().view(-1, 1) * torch.log(n)
    while factor.dim() < 3:
        factor = factor.unsqueeze(0)
    q = (q.float() * factor.unsqueeze(-1)).to(q.dtype)
    return psoftmax_attention(q, k, v, 1.0, scale=scale, causal=causal, attn_mask=attn_mask, enable_gqa=enable_gqa)


def softmax1_attention(q, k, v, sink, *, scale=None, causal=True, attn_mask=None, enable_gqa=False):
    """softmax+1: weights = exp(s) / (exp(b_h) + sum exp(s)), b_h the per-head sink logit."""
    k, v = _expand(q, k, v, enable_gqa)
    s, allowed = _logits(q, k, scale, causal, attn_mask)
    b = sink.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    m = torch.maximum(s.amax(-1, keepdim=True), b)
    e = torch.exp(s - m)
    w = e / (torch.exp(b - m) + e.sum(-1, keepdim=True))
    return (w @ v.float()).to(q.dtype)


__all__ = ["psoftmax_attention", "ssmax_attention", "softmax1_attention", "visible_counts", "causal_mask",
           "combine_causal"]
