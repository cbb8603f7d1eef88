"""Zero-shot probes, before any training: what a schedule position costs, and which heads a norm will hurt.

    schedule_losses(model, ids, [0, 0.25, 0.5, 1])   # [(t, knob value, loss)]: the loss along the schedule
    head_spread(model, ids)                      # (layers, H): 1 - mean(rms)^2 / mean(rms^2) over tokens

A head whose output RMS varies a lot from token to token (spread near 1) is one a per-token normalization
changes most: AVNorm flattens exactly that variation (measured on SmolLM2-135M: mean 0.20, max 0.64).
`retrofit patch MODEL --norm avnorm --check-text FILE --schedule-values 0,0.25,0.5,1` prints both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..norms.attention_call import visible_keys
from ..observer import observe
from ..patching import CHILD, is_patched
from .bypass import patch_bypassed
from .schedule import scheduled_norms, set_schedule_position


@torch.no_grad()
def head_spread(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids -> (layers, H) per-head spread of the ORIGINAL model's output RMS across tokens."""
    sums: list[torch.Tensor] = []  # per layer: (2, H) sum of rms and of rms^2

    def fn(module, query, key, value, attention_mask, scaling, norm):
        key, value, mask, causal = visible_keys(module, query, key, value, attention_mask, None)
        out = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask,
                                             is_causal=causal and mask is None, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])  # (B, H, T, D)
        rms = out.float().pow(2).mean(-1).sqrt()  # (B, H, T)
        sums.append(torch.stack([rms.mean((0, 2)), rms.pow(2).mean((0, 2))]))

    bypass = patch_bypassed(model) if any(CHILD in m._modules for m in model.modules()) else _nothing()
    with bypass, observe(model, fn):
        model(input_ids=ids, use_cache=False)
    stats = torch.stack(sums)  # (layers, 2, H)
    return 1.0 - stats[:, 0].pow(2) / stats[:, 1].clamp_min(1e-30)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def schedule_losses(model: nn.Module, ids: torch.Tensor, positions, *, start: float | None = None,
                end: float | None = None) -> list[tuple[float, float, float]]:
    """Mean next-token loss of one (1, T) sequence at each schedule position; the knobs are left at the end."""
    if not is_patched(model):
        scheduled_norms(model)  # the one-line error
    rows = []
    try:
        for t in positions:
            value = set_schedule_position(model, float(t), start=start, end=end)[0]
            loss = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
            rows.append((float(t), value, loss))
    finally:
        set_schedule_position(model, 1.0, start=start, end=end)
    return rows


PROBE_POINTS = 9  # shape=loss without costs: the path start -> end probed at 0, 1/8, ..., 1


@torch.no_grad()
def schedule_costs(model: nn.Module, ids: torch.Tensor, *, start: float | None = None, end: float | None = None,
                   points: int = PROBE_POINTS) -> list[float]:
    """recovery.schedule.costs measured: the loss of one (1, T) sequence at `points` evenly spaced positions of the
    straight path start -> end, in eval mode (no dropout); the knobs are left at the end."""
    was_training = model.training
    model.eval()
    try:
        rows = schedule_losses(model, ids, [i / (points - 1) for i in range(points)], start=start, end=end)
    finally:
        model.train(was_training)
    return [loss for _, _, loss in rows]


def describe_spread(spread: torch.Tensor, top: int = 5) -> str:
    """One paragraph: mean and max spread, and the heads a norm will change most."""
    flat = spread.flatten()
    order = flat.argsort(descending=True)[:top].tolist()
    heads = ", ".join(f"L{i // spread.shape[1]}.h{i % spread.shape[1]} {float(flat[i]):.2f}" for i in order)
    return (f"per-head spread 1 - mean(rms)^2/mean(rms^2): mean {float(flat.mean()):.3f}, max {float(flat.max()):.3f}"
            f" (most changed by a per-token norm: {heads})")
