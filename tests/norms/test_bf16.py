"""bf16 autocast: Llama-family RoPE hands the attention function q, k in fp32 and v in bf16; every norm trains.

The kernels treat dtypes as SDPA does. Under autocast q, k, v are cast to the autocast dtype, computed in it
with fp32 accumulation, and out is in that dtype. Outside autocast mixed dtypes are upcast to the widest
(fp32 accumulation), out comes back in v's dtype; either way each gradient is in its input's dtype.
"""

from __future__ import annotations

import pytest
import torch

import retrofit
import retrofit.kernels as K
from retrofit.norms import Norm, get_norm
from tests.kernels.test_kernels import KERNELS, call, extra_param, make, naive_ssmax_rounded
from tests.tiny import random_ids, tiny_model


@pytest.fixture(params=["auto", "blockwise", "decode"])
def backend(request):
    with K.force_backend(None if request.param == "auto" else request.param):
        yield request.param


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


BACKEND_MODULES = ("blockwise", "cpu_fused", "decode")


def spy_backends(monkeypatch):
    """Record (backend, q/k/v dtypes, k and v data pointers) for every backend forward call."""
    seen = []
    for name in BACKEND_MODULES:
        module = getattr(K, name)

        def spy(q, k, v, *args, _real=module.forward, _name=name, **kw):
            seen.append((_name, (q.dtype, k.dtype, v.dtype), (k.data_ptr(), v.data_ptr())))
            return _real(q, k, v, *args, **kw)
        monkeypatch.setattr(module, "forward", spy)
    return seen


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("setting", ["causal", "decode", "gqa_pad"])
def test_autocast_computes_in_the_autocast_dtype(one_thread, monkeypatch, backend, name, setting):
    """Under CPU bf16 autocast, as SDPA: q, k, v reach the backend in bf16 and out is bf16.

    Inputs are fp32 q, k (as RoPE returns them) and bf16 v. The backend must compute the bf16 inputs
    with fp32 accumulation, so out equals the float64 reference *on the bf16-rounded inputs* to within
    one bf16 rounding of the output (2^-8 relative) plus, where a backend rounds the weights to bf16 before
    the P V product as flash attention does (the fused CPU kernel), 2^-9 sum_j A_ij |v_j| (atol 2^-8 for
    these |v| ~ 1); and the fp32 reference within bf16 input rounding (logits of size ~3 move by ~2^-8 * 3;
    3e-2 covers it). Gradients come back finite and nonzero, in their inputs' dtypes.
    """
    q, k, v, kw = make(setting)
    extra = extra_param(q.shape[1], torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v.to(torch.bfloat16)))
    seen = spy_backends(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(name, q, k, v, extra, **kw)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for _, dtypes, _ in seen), seen
    if backend != "auto":
        assert {used for used, _, _ in seen} == {backend}
    assert out.dtype == torch.bfloat16
    rounded = [x.detach().to(torch.bfloat16) for x in (q, k, v)]
    _, reference, param = KERNELS[name]
    if name == "ssmax":  # the kernel's bf16 input is the scaled q, s_h log(n_i) q_i, rounded once
        ref16 = naive_ssmax_rounded(q.detach(), k.detach(), v.detach(), extra, torch.bfloat16, **kw)
    else:
        ref16 = reference(*rounded, *(() if param is None else (extra,)), **kw)
    torch.testing.assert_close(out.double(), ref16, rtol=2 ** -8, atol=2 ** -8)
    ref32 = reference(q.detach(), k.detach(), v.detach().float(), *(() if param is None else (extra,)), **kw)
    torch.testing.assert_close(out.double(), ref32, rtol=3e-2, atol=3e-2)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    assert all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", list(KERNELS))
def test_autocast_only_casts_the_inputs(one_thread, backend, name):
    """Autocast changes the inputs' dtype and nothing inside the kernels: forward and backward (run inside
    autocast) are bitwise those of the same call on inputs cast to bf16 by hand, outside autocast. (The
    blockwise worker threads do not inherit autocast; were it left on in the calling thread, its matmuls
    would round differently from theirs.)"""
    q, k, v, kw = make("causal")
    extra = extra_param(q.shape[1], torch.float32)
    if name == "ssmax":  # it scales q before rounding it (once), so a q rounded by hand first would differ
        q = q.to(torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = call(name, q, k, v, extra, **kw)
        grads = torch.autograd.grad(under, (q, k, v), dout.to(torch.bfloat16))  # backward inside autocast too
    by_hand = call(name, *(x.to(torch.bfloat16) for x in (q, k, v)), extra, **kw)
    hand_grads = torch.autograd.grad(by_hand, (q, k, v), dout.to(torch.bfloat16))
    assert under.dtype == torch.bfloat16 and torch.equal(under, by_hand)
    assert all(torch.equal(a, b) for a, b in zip(grads, hand_grads))


def test_ssmax_passes_k_and_v_on_uncopied(one_thread, monkeypatch):
    """SSMax scales q only: bf16 k and v reach the backend as the very tensors given (no fp32 copies)."""
    q, k, v, kw = make("gqa_pad", torch.bfloat16)
    seen = spy_backends(monkeypatch)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = K.ssmax_attention(q, k, v, extra_param(q.shape[1], torch.float32), enable_gqa=True, **kw)
        assert out.dtype == torch.bfloat16
    assert len(seen) == 2 and all(ptrs == (k.data_ptr(), v.data_ptr()) for _, _, ptrs in seen)
    assert all(dtypes == (torch.bfloat16,) * 3 for _, dtypes, _ in seen)


def test_non_floating_inputs_raise():
    q, k, v, kw = make("causal")
    with pytest.raises(ValueError, match="floating-point"):
        K.psoftmax_attention(q, k, v.to(torch.int64), **kw)


NORMS = [(n, get_norm(n).example_options) for n in retrofit.available_norms()]  # a new norm joins by registering


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("norm,options", NORMS, ids=[n for n, _ in NORMS])
def test_every_norm_trains_under_bf16_autocast(one_thread, family, norm, options):
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
    if any(m.has_parameters for m in model.modules() if isinstance(m, Norm)):  # the norm's own got a gradient
        assert any(".retrofit." in n for n in trainable)
