"""Sliding windows (Mistral, Qwen2, Gemma 2, Phi-3): query i sees keys i - W < j <= i, and SSMax's n is that count.

Measured on transformers 5.23 under sdpa: a sliding layer gets a bool mask with the window built in
whenever the window is not longer than the keys (T >= W), None while T < W (the window hides nothing);
a decode step gets a (1, 1, 1, W) mask over the W keys the sliding cache keeps. The kernels follow the
mask; `hides_future` sees that such a mask hides the future, so the kernels still skip future blocks.
"""

from __future__ import annotations

import copy

import pytest
import torch

import retrofit
import retrofit.kernels as K
from retrofit.kernels.masks import hides_future
from retrofit.norms.attention_call import visible_keys
from tests.kernels.test_kernels import KERNELS, extra_param, qkv
from tests.reference import naive_attention, reference_model, window_mask
from tests.tiny import random_ids, tiny_model

W, T = 8, 40


def kernel(name, q, k, v, extra, **kw):
    fn = {"psoftmax": lambda *a, **kw: K.psoftmax_attention(*a[:3], 2.0, **kw),
          "ssmax": K.ssmax_attention, "softmax1": K.softmax1_attention}[name]
    args = (q, k, v) if name == "psoftmax" else (q, k, v, extra)
    return fn(*args, enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("tq,tk", [(T, T), (5, 12), (1, W)])  # full, a chunk onto a cache, one decode step
@pytest.mark.parametrize("small_blocks", [False, True])
def test_kernels_follow_a_window_mask(one_thread, monkeypatch, name, tq, tk, small_blocks):
    if small_blocks:
        monkeypatch.setattr(K.blockwise, "BLOCK_ELEMS", 64)
        monkeypatch.setattr(K.blockwise, "MAX_ROWS", 4)
        monkeypatch.setattr(K.blockwise, "MIN_ROWS", 2)
        monkeypatch.setattr(K.cpu_fused, "MASK_ELEMS", 64)
        monkeypatch.setattr(K.cpu_fused, "MIN_ROWS", 3)
    q, k, v = (x.requires_grad_() for x in qkv(B=2, H=4, Hkv=2, Tq=tq, Tk=tk, seed=tq))
    mask = window_mask(tq, tk, W)[None, None]
    causal = hides_future(mask, tq, tk)
    assert causal  # the kernels are told they may skip the future
    extra = extra_param(4, torch.float32).requires_grad_()
    out = kernel(name, q, k, v, extra, causal=causal, attn_mask=mask)
    want = naive_attention(q, k, v, name, p=2.0, s_param=extra, sink=extra, causal=False, window=W)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)
    wrt = (q, k, v) if name == "psoftmax" else (q, k, v, extra)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    for g, e in zip(torch.autograd.grad(out, wrt, dout), torch.autograd.grad(want, wrt, dout.double())):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-5)
    if tq == T:  # the window really hides keys: the full causal answer is different
        full = naive_attention(q, k, v, name, p=2.0, s_param=extra, sink=extra, causal=True)
        assert (want - full).abs().max() > 1e-2


def test_ssmax_n_is_the_window_limited_count():
    mask = window_mask(T, T, W)[None, None]
    n = K.visible_counts(mask, True, T, T, None).expand(1, 1, T)[0, 0]
    assert n.tolist() == [min(pos + 1, W) for pos in range(T)]
    decode = window_mask(1, W, W)[None, None]  # the sliding cache keeps W keys; the new query sees them all
    assert K.visible_counts(decode, True, 1, W, None).flatten().tolist() == [W]


def test_visible_keys_calls_a_window_mask_causal():
    module = torch.nn.Module()
    module.is_causal = True
    q = k = v = torch.zeros(1, 2, T, 4)
    assert visible_keys(module, q, k, v, window_mask(T, T, W)[None, None], None)[3] is True


# ---------------------------------------------------------------- tiny Mistral and Qwen2 with a window of 8

FAMILIES = {  # model_type -> (config overrides, layer types transformers should derive)
    "mistral": (dict(sliding_window=W), None),
    "qwen2": (dict(sliding_window=W, use_sliding_window=True, max_window_layers=1),
              ["full_attention", "sliding_attention"]),
}
NORMS = {"psoftmax": {"p": 2.0}, "ssmax": {}, "softmax1": {"learnable": True}}
MATRIX = [(f, n) for f in FAMILIES for n in NORMS]


def pair(family, norm):
    overrides, layer_types = FAMILIES[family]
    original = tiny_model(family, **overrides)
    assert original.config.sliding_window == W and getattr(original.config, "layer_types", None) == layer_types
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    retrofit.patch(model, norm, **NORMS[norm])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return original, model


def is_sliding(family, layer):
    return family == "mistral" or FAMILIES[family][1][layer] == "sliding_attention"


@pytest.mark.parametrize("family,norm", MATRIX)
def test_model_matches_float64_reference_with_the_window(one_thread, family, norm):
    original, model = pair(family, norm)
    ids = random_ids(2, T)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference_model(original, model, nope=False)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", list(NORMS))
def test_mistral_cannot_see_past_two_windows(one_thread, norm):
    """Two sliding layers: token 0 reaches at most position 2 (W - 1) = 14; nothing later may change."""
    _, model = pair("mistral", norm)
    ids = random_ids(1, T)
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 7) % 90 + 3
    with torch.no_grad():
        a, b = model(ids).logits[0], model(changed).logits[0]
    assert torch.equal(a[2 * (W - 1) + 1:], b[2 * (W - 1) + 1:])
    assert (a[:W] - b[:W]).abs().max() > 1e-4


@pytest.mark.parametrize("family,norm", MATRIX)
def test_prefill_then_decode_equals_full_forward(one_thread, monkeypatch, family, norm):
    _, model = pair(family, norm)
    counts = []  # SSMax's n per call, in layer order (query head 0, batch row 0)
    real = K.visible_counts
    monkeypatch.setattr(K, "visible_counts", lambda mask, causal, tq, tk, dev: counts.append(
        real(mask, causal, tq, tk, dev).expand(1, 1, tq)[0, 0].tolist()) or real(mask, causal, tq, tk, dev))
    ids = random_ids(1, T)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :20], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(20, T):
            step = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(step.logits)
            cache = step.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    if norm == "ssmax":
        layers = model.config.num_hidden_layers
        positions = [list(range(T)), list(range(20))] + [[t] for t in range(20, T)]
        expect = [[min(p + 1, W) if is_sliding(family, layer) else p + 1 for p in pos]
                  for pos in positions for layer in range(layers)]
        assert counts == expect
