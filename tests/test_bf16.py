"""bf16 autocast: Llama-family RoPE hands the attention function q, k in fp32 and v in bf16; every norm trains.

The kernels accept mixed q/k/v dtypes as SDPA does: upcast to the widest, compute (fp32 accumulation),
return out in v's dtype and each gradient in its input's dtype.
"""

from __future__ import annotations

import pytest
import torch

import retrofit
import retrofit.kernels as K
from tests.test_kernels import KERNELS, call, extra_param, make
from tests.tiny import random_ids, tiny_model


@pytest.fixture(params=["auto", "blockwise"])
def backend(request, monkeypatch):
    monkeypatch.setattr(K, "FORCE_BACKEND", None if request.param == "auto" else request.param)
    return request.param


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("setting", ["causal", "gqa_pad", "prefill_chunk"])
def test_mixed_dtypes_equal_the_fp32_result_rounded_once(one_thread, backend, name, setting):
    """q, k fp32 and v bf16 is defined as: upcast v, compute in fp32, round out to bf16 once.

    So out must be bitwise the fp32 result rounded to bf16 (at most half a bf16 ulp, 2^-9 relative, from
    it), dq and dk bitwise the fp32 ones, dv the fp32 dv rounded to bf16; anything looser would mean a
    bf16 intermediate crept in (a bf16 matmul would be off by ~2^-8 per product, visibly more).
    """
    q, k, v, kw = make(setting)
    v16 = v.to(torch.bfloat16)
    extra = extra_param(q.shape[1], torch.float32)
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v16))
    out = call(name, q1, k1, v1, extra, **kw)
    assert out.dtype == torch.bfloat16
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (q1, k1, v1), dout)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]

    q2, k2, v2 = (x.clone().requires_grad_() for x in (q, k, v16.float()))
    want = call(name, q2, k2, v2, extra, **kw)  # all fp32
    want_grads = torch.autograd.grad(want, (q2, k2, v2), dout.float())
    assert torch.equal(out, want.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=0)  # the bf16 rounding bound, stated
    assert torch.equal(grads[0], want_grads[0]) and torch.equal(grads[1], want_grads[1])
    assert torch.equal(grads[2], want_grads[2].to(torch.bfloat16))


def test_kernels_ignore_an_enclosing_autocast(one_thread):
    """Inside autocast the blockwise matmuls would run in bf16; the kernels switch it off, forward and backward."""
    q, k, v, kw = make("causal")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    plain = K.psoftmax_attention(q, k, v, 3.0, **kw)
    plain_grads = torch.autograd.grad(plain.square().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = K.psoftmax_attention(q, k, v, 3.0, **kw)
        grads = torch.autograd.grad(under.square().sum(), (q, k, v))  # backward inside autocast too
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_non_floating_inputs_raise():
    q, k, v, kw = make("causal")
    with pytest.raises(ValueError, match="floating-point"):
        K.psoftmax_attention(q, k, v.to(torch.int64), **kw)


NORMS = [("avnorm", {}), ("psoftmax", {"p": 2.0}), ("ssmax", {}), ("softmax1", {"learnable": True}), ("softmax", {})]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("norm,options", NORMS, ids=[n for n, _ in NORMS])
def test_every_norm_trains_under_bf16_autocast(one_thread, family, norm, options):
    assert {n for n, _ in NORMS} == set(retrofit.available_norms())  # a new norm must join this test
    model = tiny_model(family)
    retrofit.patch(model, norm, **options)
    model.train()
    ids = random_ids(2, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        assert loss.isfinite()
        loss.backward()
        for n, p in model.named_parameters():
            if n in trainable:
                assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, n
        opt.step()
    if norm != "softmax":  # the norm's own parameters are among those that got a gradient
        assert norm == "psoftmax" or any(".retrofit." in n for n in trainable)
