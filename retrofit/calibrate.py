"""Calibrated per-head gains (AVNorm; p-softmax with `gain`): start a retrofit near the pretrained model's function.

A pretrained model's output projection expects each head's own output scale. Unit-gain RMSNorm
throws that away (measured on SmolLM2-135M: loss on a paragraph 0.44 -> 17.05); setting each head's
gain to its mean output RMS on some text restores it (0.61 before any training).

During calibration the norms only observe: every layer sees the original model's activations, so
each head's gain is matched to the statistics the pretrained model actually produces.

p-softmax changes scale too (its output is softmax's times exp(LSE(s) - LSE(p*s)/p) >= 1, orders of magnitude
apart per head); patched with `gain=1.0` it has a per-head gain that this sets the same way: mean RMS of the
original head output over mean RMS of the full p-softmax output.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import RetrofitError
from .norms.avnorm import AVNorm
from .norms.psoftmax import PSoftmax
from .patch import check_unsharded
from .record import read_record, write_record


def calibrated_norms(model: nn.Module) -> list[nn.Module]:
    """The norm modules that carry a per-head gain calibrate() can set."""
    return [m for m in model.modules()
            if isinstance(m, AVNorm) or (isinstance(m, PSoftmax) and m.gain is not None)]


def _unpack(batch):
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"], batch.get("attention_mask")
    raise RetrofitError("calibration batches must be LongTensors or dicts with input_ids (and attention_mask)")


@torch.no_grad()
def calibrate(model: nn.Module, batches, *, max_batches: int | None = None) -> dict:
    """Set each head's gain to mean_tokens RMS(original head output) / mean_tokens RMS(normalized output).

    For kind=rms (and layer) the normalized RMS is ~1, so the gain is the head's mean output RMS.
    Padding (attention_mask == 0) is excluded. Returns a summary, also recorded in config.retrofit.
    """
    norms = calibrated_norms(model)
    if not norms:
        raise RetrofitError("calibrate needs a model patched with avnorm (or psoftmax with gain=1.0); no norm "
                            "with a per-head gain found")
    check_unsharded(norms, "calibrate")
    device = next(model.parameters()).device
    before = [torch.zeros(n.shape.num_heads, dtype=torch.float64, device=device) for n in norms]
    after = [torch.zeros_like(b) for b in before]
    tokens, used, was_training = 0, 0, model.training
    model.eval()
    for n in norms:
        n.calibration = []
    try:
        for batch in batches:
            if max_batches is not None and used >= max_batches:
                break
            ids, mask = _unpack(batch)
            ids = ids.to(device)
            mask = torch.ones_like(ids) if mask is None else mask.to(device)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            valid = mask.bool()[..., None]  # (B, T, 1)
            for i, n in enumerate(norms):
                rms_in, rms_out = n.calibration.pop()  # (B, T, H) each
                before[i] += (rms_in * valid).sum((0, 1)).double()
                after[i] += (rms_out * valid).sum((0, 1)).double()
            tokens += int(valid.sum())
            used += 1
    finally:
        for n in norms:
            n.calibration = None
        model.train(was_training)
    if tokens == 0:
        raise RetrofitError("calibration saw no tokens: pass at least one non-empty batch of text")
    gains = []
    for i, n in enumerate(norms):
        gain = (before[i] / after[i].clamp_min(1e-12)).to(n.gain.dtype)
        n.gain.data.copy_(gain)
        gains.append(gain)
    g = torch.cat(gains).float()
    summary = {"tokens": tokens, "batches": used, "gain_mean": round(float(g.mean()), 6),
               "gain_min": round(float(g.min()), 6), "gain_max": round(float(g.max()), 6)}
    if read_record(model) is not None:
        write_record(model, calibration=summary)
    return summary
