"""A saved checkpoint's weights against the model built for it: the base weights all there and nothing else, and
the patch's own tensors (keys containing `.retrofit.`) exactly the ones the rebuilt patch has, finite.

    check_base_keys(source, model, record, info)   # transformers' loading report, after the base loaded plain
    load_patch_tensors(model, saved, source)        # the patch tensors into the patched model, or one line

retrofit's loader (load/patched_checkpoint.py) and a standalone export's modeling file (hub/standalone.py, which vendors
this module and what it imports) check a checkpoint with these same functions.
"""

from __future__ import annotations

import torch

from .errors import RetrofitError
from .families import family_of
from .norms.base import CHILD

# Buffers older checkpoints saved that transformers now recomputes: not weights, so never "unexpected".
STALE_BUFFERS = (".attn.masked_bias", ".attn.bias", ".rotary_emb.inv_freq")
MARKER = f".{CHILD}."  # in every key of a patch tensor


def listed(keys) -> str:
    """Up to three names of a set of keys, for a one-line error."""
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def check_loaded_keys(source: str, info: dict, *, removed: str | None = None, patch_marker: str | None = None) -> None:
    """What transformers loaded matches the model built: nothing missing (it would stay random), nothing extra
    (another model's weights, or a config that builds fewer layers), nothing of the wrong shape. removed: a
    prefix the patch itself removes (NoPE's learned position table); patch_marker: keys the patch adds, checked
    apart (load_patch_tensors)."""
    missing = {k for k in info.get("missing_keys", ()) if not (removed and k.startswith(removed))}
    unexpected = {k for k in info.get("unexpected_keys", ())
                  if not (patch_marker and patch_marker in k) and not k.endswith(STALE_BUFFERS)}
    mismatched = {k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys", ())}
    problems = [f"{what} {listed(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                             ("of the wrong shape", mismatched)) if keys]
    if problems:
        raise RetrofitError(f"{source} is damaged or was saved from another model: weights {'; '.join(problems)}; "
                            "save the model again (loading it would leave those weights random)")


def check_base_keys(source: str, model, record: dict, info: dict) -> None:
    """The base weights of a checkpoint are all there and nothing else is, apart from what the patch itself adds
    (keys containing `.retrofit.`, checked by load_patch_tensors) or removes (NoPE's learned position table)."""
    family = family_of(model.config)
    removed = f"{family.positions_path}." if record.get("nope") and family and family.positions == "learned" else None
    check_loaded_keys(source, info, removed=removed, patch_marker=MARKER)


def check_finite(tensors: dict, source: str) -> None:
    """The patch's saved parameters are finite: a NaN gain would make every output NaN, silently until used."""
    for key, tensor in sorted(tensors.items()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RetrofitError(f"{source}: patch tensor {key} holds NaN or infinite values; the checkpoint is "
                                "damaged (or training diverged): save a good model again")


def load_patch_tensors(model, saved: dict, source: str) -> None:
    """Put the saved patch tensors into the patched model: exactly the ones the patch has, of its shapes."""
    check_finite(saved, source)
    expected = {k: v for k, v in model.state_dict().items() if MARKER in k}
    missing, unexpected = expected.keys() - saved.keys(), saved.keys() - expected.keys()
    wrong = {k for k in expected.keys() & saved.keys() if saved[k].shape != expected[k].shape}
    if missing:
        raise RetrofitError(f"{source} lacks {len(missing)} patch tensors ({listed(missing)}): "
                            "the checkpoint is incomplete; save it again with model.save_pretrained")
    if unexpected or wrong:
        what = f"unexpected {listed(unexpected)}" if unexpected else f"of the wrong shape {listed(wrong)}"
        raise RetrofitError(f"{source}'s patch tensors do not match its config.retrofit record ({what}); "
                            "save the model again with model.save_pretrained")
    model.load_state_dict(saved, strict=False)


__all__ = ["MARKER", "STALE_BUFFERS", "check_base_keys", "check_finite", "check_loaded_keys", "listed",
           "load_patch_tensors"]
