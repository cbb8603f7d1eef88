"""Mask conventions shared by the kernels: bool (True = attend) or additive float, causal aligned bottom-right."""

from __future__ import annotations

import torch


def visible_counts(mask: torch.Tensor | None, causal: bool, q_len: int, kv_len: int,
                   device: torch.device) -> torch.Tensor:
    """Number of keys each query may see, broadcastable to (B, H, Tq); at least 1. No T x T tensor of our own."""
    if mask is None:
        if causal:
            return torch.arange(kv_len - q_len + 1, kv_len + 1, device=device, dtype=torch.float32)
        return torch.full((q_len,), float(kv_len), device=device)
    if causal:
        mask = combine_causal(mask, q_len, kv_len)
    if mask.dtype == torch.bool:
        allowed = mask
    else:  # additive: transformers marks hidden keys with the dtype's minimum (or -inf)
        allowed = mask > torch.finfo(mask.dtype).min / 2
    return allowed.sum(-1, dtype=torch.float32).clamp_min(1.0)


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True = attend; queries are the last Tq positions (bottom-right alignment)."""
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= rows


def combine_causal(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    c = causal_mask(q_len, kv_len, mask.device)
    if mask.dtype == torch.bool:
        return mask & c
    return mask.masked_fill(~c, float("-inf"))
