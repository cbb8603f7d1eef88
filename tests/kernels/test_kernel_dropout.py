"""Attention-weight dropout in retrofit's kernels: the weights it drops, its scaling, its gradients,
its reproducibility, and that patched models apply it in training only.

The kernels never materialize the weights, so the tests read them out: with v the identity (one value
row per key), out_i = A_i * M_i / (1 - rate) is the dropped weight row itself. The mask recovered that
way (same seed, same shapes) then drives an independent float64 reference for forward and backward.
"""

from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.kernels import psoftmax_attention, softmax1_attention, ssmax_attention
from tests.kernels.test_kernels import left_padding, naive_psoftmax, naive_softmax1, naive_ssmax
from tests.tiny import random_ids, tiny_model

RATE = 0.3


def _s_param(H):
    return torch.linspace(0.8, 1.3, H, dtype=torch.float64)


def _sink(H):
    return torch.linspace(-1.0, 1.0, H, dtype=torch.float64)


CASES = {  # name -> (kernel(q, k, v, **kw), naive(q, k, v, **kw), extra parameter builder)
    "psoftmax-p2": (lambda q, k, v, **kw: psoftmax_attention(q, k, v, 2.0, **kw),
                    lambda q, k, v, **kw: naive_psoftmax(q, k, v, 2.0, **kw), None),
    "psoftmax-p1.5": (lambda q, k, v, **kw: psoftmax_attention(q, k, v, 1.5, **kw),
                      lambda q, k, v, **kw: naive_psoftmax(q, k, v, 1.5, **kw), None),
    "softmax": (lambda q, k, v, **kw: psoftmax_attention(q, k, v, 1.0, **kw),
                lambda q, k, v, **kw: naive_psoftmax(q, k, v, 1.0, **kw), None),
    "ssmax": (ssmax_attention, naive_ssmax, _s_param),
    "softmax1": (softmax1_attention, naive_softmax1, _sink),
}


def _inputs(B=2, H=4, Hkv=2, T=24, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype)
    return q, k, v


def _call(name, q, k, v, extra, seed, **kw):
    kernel = CASES[name][0]
    torch.manual_seed(seed)  # the kernel draws its mask seed from torch's default generator
    args = (extra,) if extra is not None else ()
    return kernel(q, k, v, *args, enable_gqa=q.shape[1] != k.shape[1], **kw)


def _dropped_weights(name, q, k, extra, seed, **kw):
    """The kernel's dropped weights A * M / (1 - rate), (B, H, Tq, Tk), read out with v = identity."""
    B, Hkv, Tk = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(Tk, dtype=q.dtype).expand(B, Hkv, Tk, Tk)
    return _call(name, q, k, eye, extra, seed, **kw)


def _settings(name, B, T):
    if name == "causal":
        return dict(causal=True)
    return dict(causal=False, attn_mask=left_padding(B, T, T, [0, 5], "bool"))


@pytest.mark.parametrize("setting", ["causal", "padded"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dropout_drops_normalized_weights_and_rescales_the_rest(name, setting):
    q, k, v = _inputs()
    extra = CASES[name][2](q.shape[1]) if CASES[name][2] else None
    kw = _settings(setting, q.shape[0], q.shape[2])
    weights = _dropped_weights(name, q, k, extra, 0, **kw)
    plain = _dropped_weights(name, q, k, extra, 0, **kw, dropout_p=0.0)
    naive = CASES[name][1](q, k, torch.eye(k.shape[2], dtype=q.dtype).expand(*k.shape[:3], k.shape[2]),
                           *((extra,) if extra is not None else ()), **kw)
    torch.testing.assert_close(plain, naive, rtol=1e-10, atol=1e-12)  # the read-out really is the weights
    weights = _dropped_weights(name, q, k, extra, 0, **kw, dropout_p=RATE)
    visible = plain > 0
    kept = weights != 0
    assert not (kept & ~visible).any()  # nothing appears where no weight was
    torch.testing.assert_close(weights[kept], plain[kept] / (1 - RATE), rtol=1e-12, atol=0)
    dropped = (visible & ~kept).sum().item() / visible.sum().item()
    n = visible.sum().item()
    assert abs(dropped - RATE) < 4 * (RATE * (1 - RATE) / n) ** 0.5, (dropped, n)
    # independent across query heads and batch rows, not one mask broadcast
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0, 0], kept[1, 0])


@pytest.mark.parametrize("setting", ["causal", "padded"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dropout_forward_and_gradients_match_a_reference_with_the_same_mask(name, setting):
    q, k, v = _inputs(seed=1)
    builder = CASES[name][2]
    kw = _settings(setting, q.shape[0], q.shape[2])
    extra = builder(q.shape[1]) if builder else None
    keep = _dropped_weights(name, q, k, extra, 7, **kw, dropout_p=RATE) != 0  # the mask of seed 7

    inputs = [t.clone().requires_grad_() for t in (q, k, v)] + ([extra.clone().requires_grad_()] if builder else [])
    out = _call(name, *inputs[:3], inputs[3] if builder else None, 7, **kw, dropout_p=RATE)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    H, Hkv, Tk = q.shape[1], k.shape[1], k.shape[2]
    eye = torch.eye(Tk, dtype=q.dtype).expand(q.shape[0], Hkv, Tk, Tk)
    weights = CASES[name][1](ref_inputs[0], ref_inputs[1], eye, *ref_inputs[3:], **kw)  # A, autograd in float64
    ref = (weights * keep / (1 - RATE)) @ ref_inputs[2].repeat_interleave(H // Hkv, 1)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-8, atol=1e-10)


def test_dropout_follows_the_torch_seed_and_zero_is_the_plain_kernel():
    q, k, v = _inputs(dtype=torch.float32)
    a = _call("psoftmax-p2", q, k, v, None, 3, dropout_p=RATE)
    b = _call("psoftmax-p2", q, k, v, None, 3, dropout_p=RATE)
    c = _call("psoftmax-p2", q, k, v, None, 4, dropout_p=RATE)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert torch.equal(_call("psoftmax-p2", q, k, v, None, 3, dropout_p=0.0),
                       psoftmax_attention(q, k, v, 2.0, enable_gqa=True))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        psoftmax_attention(q, k, v, 2.0, enable_gqa=True, dropout_p=1.0)


def test_the_mask_does_not_depend_on_the_thread_count(monkeypatch):
    import retrofit.kernels.blockwise as blockwise
    q, k, v = _inputs(B=1, H=2, Hkv=2, T=300, dtype=torch.float32)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMS", 2 * 64 * 300)  # many row blocks; rows would shrink with threads
    monkeypatch.setattr(blockwise, "_threads", lambda device: 1)
    one = _call("psoftmax-p2", q, k, v, None, 5, dropout_p=RATE)
    monkeypatch.setattr(blockwise, "_threads", lambda device: 2)
    two = _call("psoftmax-p2", q, k, v, None, 5, dropout_p=RATE)
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm,options", [("psoftmax", {"p": 2.0}), ("ssmax", {}), ("softmax1", {})])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_patched_models_apply_attention_dropout_in_training_only(family, norm, options):
    rate = {"gpt2": {"attn_pdrop": 0.5}, "llama": {"attention_dropout": 0.5}}[family]
    model = tiny_model(family, **rate)
    retrofit.patch(model, norm, **options)
    ids = random_ids(2, 16)
    model.eval()
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(model(ids).logits, ref)
    model.train()  # (the tiny configs have no other dropout in the attention path)
    torch.manual_seed(0)
    a = model(ids).logits
    torch.manual_seed(0)
    b = model(ids).logits
    c = model(ids).logits
    assert torch.equal(a, b) and not torch.allclose(a, c) and not torch.allclose(a, ref)
    a.sum().backward()  # and it trains: gradients through the dropped weights are finite
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_activation_checkpointing_recomputes_the_same_mask():
    import copy

    from retrofit.train.model_setup import enable_gradient_checkpointing
    model = tiny_model("llama", attention_dropout=0.5)
    retrofit.patch(model, "psoftmax", p=2.0)
    twin = copy.deepcopy(model)
    enable_gradient_checkpointing(twin)  # the backward re-runs each layer's forward, drawing the seed again
    model.train(), twin.train()
    ids = random_ids(2, 16)
    for m in (model, twin):
        torch.manual_seed(0)
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
