"""Logit soft-capping (Gemma 2's `attn_logit_softcapping`): the scaled logits pass through c * tanh(s / c).

    s_ij  = scale * q_i . k_j                  (SSMax: q_i already multiplied by s_h log n_i)
    s'_ij = c * tanh(s_ij / c)                 bounded to (-c, c); ~ s_ij while |s_ij| << c
    then the mask bias is added to s' and the row is normalized as usual (p-norm, softmax, softmax+1).

This is the order of transformers' eager Gemma 2 attention (cap, then add the mask, then softmax),
so a hidden key stays hidden (-inf is added after the tanh) and a finite additive bias is not capped.
Backward: ds_ij = ds'_ij * d s'/d s = ds'_ij * (1 - tanh^2(s_ij / c)), applied before dq = scale ds k and
dk = scale ds^T q. The blockwise backend recomputes tanh(s / c) per block from q and k (as it recomputes
the logits), so soft-capping costs one more block-sized temporary and no O(T) storage.
"""

from __future__ import annotations

import math

import torch


def check_softcap(softcap, name: str) -> float | None:
    """None (no cap) or the cap as a float > 0; anything else is a one-line ValueError."""
    if softcap is None:
        return None
    try:
        c = float(softcap)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: softcap must be a number > 0 or None; got {softcap!r}") from None
    if not c > 0 or math.isinf(c):
        raise ValueError(f"{name}: softcap must be a finite number > 0 (or None for no cap); got {softcap!r}")
    return c


def cap_(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """s <- c * tanh(s / c), in place."""
    return s.div_(softcap).tanh_().mul_(softcap)


def capped_minus_norm(neg_norm: torch.Tensor, raw_over_c: torch.Tensor, softcap: float):
    """(c * tanh(raw / c) - N, tanh(raw / c)) from raw / c, overwriting raw_over_c with the tanh.

    The tanh is what the backward needs for the chain rule (see `chain_`); s - N is a new tensor.
    """
    t = raw_over_c.tanh_()
    return torch.add(neg_norm, t, alpha=softcap), t


def chain_(ds: torch.Tensor, tanh: torch.Tensor) -> torch.Tensor:
    """ds <- ds * (1 - tanh^2), in place; `tanh` is consumed (overwritten)."""
    return ds.mul_(tanh.square_().neg_().add_(1.0))
