"""Calibrated per-head gains (AVNorm; p-softmax with `gain`): start a retrofit near the pretrained model's function.

A pretrained model's output projection expects each head's own output scale. Unit-gain RMSNorm
throws that away (measured on SmolLM2-135M: loss on a paragraph 0.44 -> 17.05); setting each head's
gain to its mean output RMS on some text restores it (0.61 before any training).

During calibration the norms only observe: every layer sees the original model's activations, so
each head's gain is matched to the statistics the pretrained model actually produces.

p-softmax changes scale too (its output is softmax's times exp(LSE(s) - LSE(p*s)/p) >= 1, orders of magnitude
apart per head); patched with `gain=1.0` it has a per-head gain that this sets the same way: mean RMS of the
original head output over mean RMS of the full p-softmax output.

What a norm records, how it is summed and what is fitted from the sums are the norm's (Norm.calibration_sums,
add_calibration, fit_calibration, calibration_rows): the default is the gain above; AVNorm mode=beyond fits a per-head
exponent on RMS by length instead (retrofit/norms/avnorm.py). A text is cut into rows for it (text_rows); a recipe
calibrates on its training blocks (data.seq_len).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .attention_modules import check_unsharded
from .errors import RetrofitError
from .norms import Norm, calibrated_norm_hints
from .record import read_record, write_record


def calibrated_norms(model: nn.Module) -> list[Norm]:
    """The norm modules that carry per-head values calibrate() can set (Norm.calibrated_parameter)."""
    return [m for m in model.modules() if isinstance(m, Norm) and m.calibrated_parameter() is not None]


def row_length(model: nn.Module, rows: int = 512) -> int:
    """Tokens per calibration row: `rows` for gains (a mean over tokens), or as many as a norm's fit needs
    (Norm.calibration_rows: AVNorm mode=beyond fits on rows of L)."""
    return max([rows, *(n.calibration_rows(rows) for n in calibrated_norms(model))])


def text_rows(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """(T,) token ids -> calibrate()'s batches: (1, t) rows of row_length(model) tokens (the last may be shorter)."""
    return [row[None] for row in ids.split(row_length(model)) if len(row) > 1]


def _unpack(batch):
    """One batch -> (ids (B, T), mask (B, T) or None); a 1-D row is a batch of one."""
    if isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, Mapping) and "input_ids" in batch:  # a dict, or a tokenizer's BatchEncoding
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        raise RetrofitError("calibration batches must be LongTensors or dicts with input_ids (and attention_mask); "
                            f"got {type(batch).__name__}")
    ids = torch.as_tensor(ids)
    mask = None if mask is None else torch.as_tensor(mask)
    if ids.dim() == 1:
        ids, mask = ids[None], None if mask is None else mask[None]
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise RetrofitError(f"calibration token ids must be integers shaped (T,) or (B, T); got {tuple(ids.shape)} "
                            f"{ids.dtype}")
    return ids, mask


def as_batches(batches):
    """What calibrate() accepts, as an iterable of batches: a (B, T) or (T,) tensor or one dict is one batch; a list
    (or any iterable) holds batches, each a (T,) or (B, T) tensor or a dict with input_ids."""
    if isinstance(batches, torch.Tensor) or isinstance(batches, Mapping):
        return [batches]
    return batches


def _forward(model: nn.Module, batch, device) -> torch.Tensor:
    """One forward of `batch` (each norm records its RMS in and out); returns which tokens count, (B, T, 1): not
    padding. A batch with position_ids and no attention_mask is packed documents (data/packing.py)."""
    ids, mask = _unpack(batch)
    ids = ids.to(device)
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if positions is not None and mask is None:  # packed documents: the position resets make the mask
        positions = torch.as_tensor(positions).reshape(ids.shape)  # a (T,) row became (1, T) in _unpack
        model(input_ids=ids, position_ids=positions.to(device), use_cache=False)
        mask = torch.ones_like(ids)
    else:
        mask = torch.ones_like(ids) if mask is None else mask.to(device)
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return mask.bool()[..., None]


@torch.no_grad()
def calibrate(model: nn.Module, batches: torch.Tensor | Mapping | Iterable[torch.Tensor | Mapping], *,
              max_batches: int | None = None, progress: bool = False) -> dict:
    """Set each head's gain to mean_tokens RMS(original head output) / mean_tokens RMS(normalized output)
    (or what else the norm fits from what it records: Norm.fit_calibration; AVNorm mode=beyond: its exponent).

    For kind=rms (and layer) the normalized RMS is ~1, so the gain is the head's mean output RMS.
    Padding (attention_mask == 0) is excluded; a batch with position_ids and no attention_mask is packed
    documents (retrofit/data/packing.py), each attending within itself. `progress`: a progress bar over the
    batches (the CLI's). Returns a summary, also recorded in config.retrofit.
    """
    norms = calibrated_norms(model)
    if not norms:
        raise RetrofitError(f"calibrate needs a model patched with a norm that has per-head gains "
                            f"({calibrated_norm_hints()}); no norm with a per-head gain found")
    check_unsharded(norms, "calibrate")
    device = next(model.parameters()).device
    sums = [n.calibration_sums(device) for n in norms]
    tokens, used, was_training = 0, 0, model.training
    model.eval()
    for n in norms:
        n.calibration = []
    try:
        for batch in tqdm(as_batches(batches), desc="calibrate", unit="batch", disable=not progress, leave=False):
            if max_batches is not None and used >= max_batches:
                break
            valid = _forward(model, batch, device)  # (B, T, 1): the tokens that count
            for n, sums_n in zip(norms, sums):
                n.add_calibration(sums_n, n.calibration.pop(), valid)
            tokens += int(valid.sum())
            used += 1
    finally:
        for n in norms:
            n.calibration = None
        model.train(was_training)
    if tokens == 0:
        raise RetrofitError("calibration saw no tokens: pass at least one non-empty batch of text")
    fitted = []
    for n, sums_n in zip(norms, sums):
        param = getattr(n, n.calibrated_parameter())
        value = n.fit_calibration(sums_n)  # (H,)
        param.data.copy_(value.to(param.dtype))
        fitted.append(value)
    g = torch.cat(fitted).float()
    what = norms[0].calibrated_parameter()  # one norm per model: "gain", "exponent", ...
    summary = {"tokens": tokens, "batches": used, f"{what}_mean": round(float(g.mean()), 6),
               f"{what}_min": round(float(g.min()), 6), f"{what}_max": round(float(g.max()), 6)}
    if read_record(model) is not None:
        write_record(model, calibration=summary)
    return summary
