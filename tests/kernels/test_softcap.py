"""Logit soft-capping (Gemma 2): s -> c * tanh(s / c) on the scaled logits, before the mask, in every kernel.

Kernels: float64 gradcheck through the cap, parity (forward and gradients) with the independent naive
reference in tests/reference.py, and routing (the fused CPU kernel cannot cap). Model: a tiny Gemma 2
with attn_logit_softcapping and a sliding window, patched, against the float64 reference model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import retrofit
import retrofit.kernels as K
from tests.kernels.test_kernels import KERNELS, extra_param, make
from tests.reference import naive_attention, reference_model
from tests.tiny import random_ids, tiny_model

CAP = 0.8  # logits here are ~N(0, 1)-sized with tails past 3: well into tanh's curve


def kernel(name, q, k, v, extra, **kw):
    fn = {"psoftmax": lambda *a, **kw: K.psoftmax_attention(*a[:3], 2.0, **kw),
          "ssmax": K.ssmax_attention, "softmax1": K.softmax1_attention}[name]
    args = (q, k, v) if name == "psoftmax" else (q, k, v, extra)
    return fn(*args, enable_gqa=q.shape[1] != k.shape[1], **kw)


def reference(name, q, k, v, extra, **kw):
    return naive_attention(q, k, v, name, p=2.0, s_param=extra if name == "ssmax" else None,
                           sink=extra if name == "softmax1" else None, **kw)


@pytest.fixture(params=["auto", "blockwise"])
def backend(request):
    with K.force_backend(None if request.param == "auto" else request.param):
        yield request.param


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("setting", ["causal", "pad_bool", "pad_additive", "gqa_pad", "prefill_chunk"])
def test_gradcheck_through_the_cap(one_thread, name, setting):
    q, k, v, kw = make(setting, torch.float64)
    q, k, v = (2 * x[..., :3].contiguous() for x in (q, k, v))  # head dim 3; logits up to ~4 = 5 caps
    inputs = [x.requires_grad_() for x in (q, k, v)]
    if name != "psoftmax":
        inputs.append(extra_param(q.shape[1]).requires_grad_())
    extra = inputs[3] if len(inputs) > 3 else None
    assert torch.autograd.gradcheck(lambda *xs: kernel(name, *xs[:3], xs[3] if len(xs) > 3 else None,
                                                       softcap=CAP, **kw), inputs, eps=1e-6, atol=1e-5,
                                     fast_mode=True)
    capped = kernel(name, q, k, v, extra, softcap=CAP, **kw)
    assert (capped - kernel(name, q, k, v, extra, **kw)).abs().max() > 0.05  # the cap is really applied


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("setting", ["causal", "full", "decode", "prefill_chunk", "more_q_than_k", "pad_bool",
                                     "pad_additive", "bias_and_causal_chunk", "gqa", "gqa_pad"])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_matches_naive_reference(one_thread, backend, monkeypatch, name, setting, small_blocks):
    if small_blocks:  # 2-4 rows and one head per block: every block boundary is crossed
        monkeypatch.setattr(K.blockwise, "BLOCK_ELEMS", 64)
        monkeypatch.setattr(K.blockwise, "MAX_ROWS", 4)
        monkeypatch.setattr(K.blockwise, "MIN_ROWS", 2)
    q, k, v, kw = make(setting)
    q, k, v = (x.requires_grad_() for x in (1.5 * q, 1.5 * k, v))  # logits past the cap of 0.8
    extra = extra_param(q.shape[1], torch.float32).requires_grad_()
    out = kernel(name, q, k, v, extra, softcap=CAP, **kw)
    want = reference(name, q, k, v, extra, softcap=CAP, **kw)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)
    wrt = (q, k, v) if name == "psoftmax" else (q, k, v, extra)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(out, wrt, dout)
    expect = torch.autograd.grad(want, wrt, dout.double())
    for g, e in zip(got, expect):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-5)


def test_softcap_routes_away_from_the_fused_kernel(one_thread, monkeypatch):
    """p = 1 normally goes to PyTorch's fused CPU kernel, which cannot cap: with softcap it must not."""
    called = []
    real = K.cpu_fused.forward
    monkeypatch.setattr(K.cpu_fused, "forward", lambda *a, **kw: called.append(1) or real(*a, **kw))
    q, k, v, kw = make("causal")
    K.softmax1_attention(q, k, v, torch.zeros(2), **kw)
    assert called == [1]  # the spy sees the fused path when there is no cap
    for force in (None, "cpu_fused"):
        with K.force_backend(force):
            out = K.softmax1_attention(q, k, v, torch.zeros(2), softcap=CAP, **kw)
        torch.testing.assert_close(out.double(), reference("softmax1", q, k, v, torch.zeros(2), softcap=CAP, **kw),
                                   rtol=1e-5, atol=2e-5)
    assert called == [1]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "big"])
def test_bad_softcap_raises(bad):
    q, k, v, kw = make("causal")
    with pytest.raises(ValueError, match="softcap must be"):
        K.psoftmax_attention(q, k, v, softcap=bad, **kw)


# ---------------------------------------------------------------- a tiny Gemma 2 with soft-capping

WINDOW = 8
MODEL_NORMS = {"psoftmax": {"p": 2.0}, "ssmax": {}, "softmax1": {"learnable": True}}


def gemma2(softcap=2.0):
    """Tiny Gemma 2 with q/k weights x30: logits reach ~8, so a cap of 2 bends them hard."""
    model = tiny_model("gemma2", attn_logit_softcapping=softcap, sliding_window=WINDOW)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    return model


def patched(original, norm, **options):
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    retrofit.patch(model, norm, **{**MODEL_NORMS.get(norm, {}), **options})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def padded_batch(T=24):
    ids = random_ids(2, T)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


@pytest.mark.parametrize("norm", list(MODEL_NORMS))
def test_gemma2_matches_float64_reference(one_thread, norm):
    original = gemma2()
    model = patched(original, norm)
    ids, mask = padded_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference_model(original, model, nope=False)(input_ids=ids, attention_mask=mask).logits
        uncapped_ref = reference_model(gemma2(None), model, nope=False)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert (got[valid] - uncapped_ref[valid]).abs().max() > 1e-2  # the cap changes this model's output


def test_gemma2_p1_equals_the_unpatched_model(one_thread):
    original = gemma2()
    model = patched(original, "psoftmax", p=1.0)
    ids, mask = padded_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = original(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (got[valid] - want[valid]).abs().max() <= 1e-5


@pytest.mark.parametrize("norm", list(MODEL_NORMS))
def test_gemma2_kv_cache_equals_full_forward(one_thread, norm):
    model = patched(gemma2(), norm)
    ids = random_ids(1, 20)  # longer than the window: the sliding layer's cache drops keys
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :11], use_cache=True)
        steps = [out.logits]
        chunk = model(ids[:, 11:14], past_key_values=out.past_key_values, use_cache=True)
        steps.append(chunk.logits)
        cache = chunk.past_key_values
        for t in range(14, 20):
            step = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", list(MODEL_NORMS))
def test_gemma2_trains_a_step(one_thread, norm):
    model = patched(gemma2(), norm)
    model.train()
    ids = random_ids(2, 16)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.isfinite()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, name
    assert norm == "psoftmax" or any(".retrofit." in n for n, _ in model.named_parameters())
