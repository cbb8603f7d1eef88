"""Masks: when a padding mask already hides the future, the kernels are told `causal` and skip blocks."""

from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.kernels import masks
from retrofit.kernels.masks import causal_mask, hides_future
from retrofit.norms.attention_call import visible_keys
from tests.kernels.test_kernels import left_padding
from tests.tiny import random_ids, tiny_model


def test_hides_future_on_padding_masks():
    for kind in ("bool", "additive"):
        pad = left_padding(2, 8, 8, [0, 3], kind)
        hidden_future = (pad & causal_mask(8, 8) if kind == "bool"
                         else pad.masked_fill(~causal_mask(8, 8), torch.finfo(pad.dtype).min))
        assert hides_future(hidden_future, 8, 8)
        assert not hides_future(pad, 8, 8)  # padding only: later keys are visible
    prefill = causal_mask(3, 10)[None, None]  # 3 queries onto 7 cached keys, bottom-right aligned
    assert hides_future(prefill, 3, 10)
    top_left = causal_mask(3, 3)[None, None]
    assert not hides_future(torch.nn.functional.pad(top_left, (0, 7), value=True), 3, 10)
    shared_row = torch.ones(1, 1, 1, 8, dtype=torch.bool)  # one row for every query: sees the future
    assert not hides_future(shared_row, 8, 8)
    assert hides_future(shared_row, 1, 8)  # a single query has no future keys


def test_the_cached_answer_follows_in_place_changes():
    mask = causal_mask(300, 300)[None, None].clone()  # more rows than one check block
    assert hides_future(mask, 300, 300)
    mask[0, 0, 10, 290] = True  # a future key made visible in place
    assert not hides_future(mask, 300, 300)
    mask[0, 0, 10, 290] = False
    assert hides_future(mask, 300, 300)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_left_padded_decoder_calls_the_kernel_causally(monkeypatch, mode):
    import retrofit.norms.attention_call as base
    seen = []
    real = base.visible_keys

    def spy(*args):
        out = real(*args)
        seen.append((out[2] is not None, out[3]))
        return out

    monkeypatch.setattr(base, "visible_keys", spy)
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with mode():
        model(ids, attention_mask=mask)
    assert seen and all(has_mask and causal for has_mask, causal in seen)


def test_inference_tensors_are_checked_every_time():
    with torch.inference_mode():
        mask = causal_mask(8, 8)[None, None].clone()
        assert hides_future(mask, 8, 8)
        mask[0, 0, 2, 6] = True  # changed in place: no version counter, so never answered from the cache
        assert not hides_future(mask, 8, 8)


def test_a_bidirectional_mask_stays_non_causal():
    module = torch.nn.Module()
    module.is_causal = True
    q = k = v = torch.zeros(1, 2, 6, 4)
    full = torch.ones(1, 1, 6, 6, dtype=torch.bool)  # e.g. a prefix attended both ways
    assert visible_keys(module, q, k, v, full, None)[3] is False
    assert visible_keys(module, q, k, v, causal_mask(6, 6)[None, None], None)[3] is True


def test_sliding_and_full_masks_alternating_are_both_cached(monkeypatch):
    """Gemma 2 (eager) hands sliding and full layers two masks in turn: neither is re-checked per layer."""
    import retrofit.kernels.masks as masks
    full = causal_mask(12, 12)[None, None].clone()
    window = full & ~causal_mask(12, 12).tril(-4)[None, None]  # keys i - 4 < j <= i
    assert hides_future(full, 12, 12) and hides_future(window, 12, 12)

    def no_recheck(*args):
        raise AssertionError("re-checked a mask whose answer was cached")

    monkeypatch.setattr(masks, "causal_rows", no_recheck)
    for _ in range(3):
        assert hides_future(full, 12, 12) and hides_future(window, 12, 12)


def test_hides_future_keeps_its_answers_on_the_mask_not_in_the_module():
    mutable = {name for name, value in vars(masks).items()
               if isinstance(value, (list, dict, set)) and not name.startswith("__")}
    assert mutable == set()
    mask, other = masks.causal_mask(8, 8)[None, None].clone(), masks.causal_mask(8, 8)[None, None].clone()
    assert masks.hides_future(mask, 8, 8)
    assert getattr(mask, masks.KEPT_ANSWERS) == {(8, 8): (mask._version, True)}
    assert not hasattr(other, masks.KEPT_ANSWERS)  # another mask holds nothing of this one's
    mask[..., 0, 5] = True  # the same object, changed in place: asked afresh
    assert not masks.hides_future(mask, 8, 8)
