"""retrofit's kernels under torch.compile: the custom ops pass torch.library.opcheck, and every patched norm
compiles with fullgraph=True (no graph break) on every tiny family, forward and backward, to eager's numbers.

aot_eager runs the very ATen ops eager runs, so compiled logits and gradients must equal eager ones to
1e-6 (they come out bitwise equal here); inductor, run where a C compiler exists, fuses and reorders the
ops around the kernels, so there the bound is 1e-5.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import retrofit
import retrofit.kernels as K
from tests.tiny import random_ids, tiny_model

NORM_OPTIONS = {"psoftmax": {"p": 2.0}, "softmax1": {"learnable": True}}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for shape in ((2, 4, 20, 8), (2, 2, 20, 8),
                                                                               (2, 2, 20, 8)))
    mask = torch.rand(2, 1, 20, 20, generator=g) > 0.3
    return q, k, v, mask, torch.randn(4, generator=g).requires_grad_()


def _op_cases():
    """(op arguments) for each use of retrofit::attention: one per norm and per backend that can run here."""
    q, k, v, mask, sink = _tensors()
    common = dict(scale=0.35, causal=True, softcap=None, dropout_p=0.0)

    q_scale = (0.5 + torch.rand(1, 4, 20, generator=torch.Generator().manual_seed(3))).requires_grad_()

    def args(q, sink, mask, seed, p, backend, q_scale=None, k=k, v=v, **kw):
        kw = {**common, **kw}
        return (q, k, v, sink, mask, seed, q_scale, p, kw["scale"], kw["causal"], backend, kw["softcap"],
                kw["dropout_p"])
    half = [x.detach().to(torch.bfloat16).requires_grad_() for x in (k, v)]
    return {
        "psoftmax-blockwise": args(q, None, None, None, 2.0, "blockwise"),
        "ssmax-blockwise": args(q, None, mask, None, 1.0, "blockwise", q_scale),
        "ssmax-fp32-q-bf16-kv-decode": args(q[:, :, -2:], None, None, None, 1.0, "decode",
                                            q_scale[..., -2:].detach().requires_grad_(), *half),
        "psoftmax-decode-softcap": args(q[:, :, -3:], None, mask[:, :, -3:], None, 1.5, "decode", softcap=2.0),
        "ssmax-call-cpu_fused": args(q, None, mask, None, 1.0, "cpu_fused"),
        "softmax1-cpu_fused": args(q, sink, None, None, 1.0, "cpu_fused", causal=False),
        "softmax1-decode": args(q[:, :, -1:], sink, mask[:, :, -1:], None, 1.0, "decode"),
        "dropout-blockwise": args(q, None, mask, torch.tensor(123), 2.0, "blockwise", softcap=2.0, dropout_p=0.2),
    }


@pytest.mark.parametrize("case", list(_op_cases()))
def test_opcheck_attention(case):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the forward op."""
    report = torch.library.opcheck(torch.ops.retrofit.attention.default, _op_cases()[case])
    assert set(report.values()) == {"SUCCESS"}, report


@pytest.mark.parametrize("q_scale", [None, "ssmax"])
@pytest.mark.parametrize("backend", ["blockwise", "cpu_fused", "decode"])
def test_opcheck_attention_backward(backend, q_scale):
    q, k, v, mask, _ = (x.detach() if torch.is_tensor(x) else x for x in _tensors())
    q_scale = None if q_scale is None else 0.5 + torch.rand(2, 4, 20, generator=torch.Generator().manual_seed(3))
    args = (q, k, v, None, mask, None, q_scale, 1.0, 0.35, True, backend, None, 0.0)
    out, norm = torch.ops.retrofit.attention(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    bargs = (dout, q, k, v, out, norm, mask, None, q_scale, 1.0, 0.35, True, backend, None, 0.0)
    report = torch.library.opcheck(torch.ops.retrofit.attention_backward.default, bargs)
    assert set(report.values()) == {"SUCCESS"}, report


def _logits_and_grads(model, run, ids):
    model.zero_grad()
    logits = run(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compile_matches_eager(family, norm, backend, tolerance, length=24):
    torch._dynamo.reset()  # each case traces afresh (and the cache-size limit is never hit)
    model = tiny_model(family)
    retrofit.patch(model, norm, **NORM_OPTIONS.get(norm, {}))
    model.train()
    ids = random_ids(2, length)
    eager_logits, eager_grads = _logits_and_grads(model, model, ids)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: any graph break raises
    logits, grads = _logits_and_grads(model, compiled, ids)
    torch.testing.assert_close(logits, eager_logits, rtol=tolerance, atol=tolerance)
    assert grads.keys() == eager_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("norm", sorted(retrofit.available_norms()))
def test_every_norm_compiles_fullgraph(family, norm):
    """24 tokens: p-softmax runs blockwise, the p = 1 norms the fused CPU kernel."""
    _compile_matches_eager(family, norm, "aot_eager", 1e-6)


@pytest.mark.parametrize("norm", ["psoftmax", "softmax1"])
def test_decode_path_compiles_fullgraph(norm):
    """8 tokens: the decode backend, under compile."""
    _compile_matches_eager("llama", norm, "aot_eager", 1e-6, length=8)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="inductor on CPU compiles C++: needs a C compiler")
def test_psoftmax_compiles_with_inductor():
    _compile_matches_eager("llama", "psoftmax", "inductor", 1e-5)


def test_forced_backend_is_read_at_trace_time():
    """force_backend holds under compile too (Dynamo cannot trace a ContextVar: the name is a trace-time constant)."""
    q, k, v, _, _ = _tensors()
    torch._dynamo.reset()
    seen = []
    real = K.blockwise.forward
    fn = torch.compile(lambda q, k, v: K.psoftmax_attention(q, k, v, 1.0, enable_gqa=True), backend="aot_eager",
                       fullgraph=True)
    try:
        K.blockwise.forward = lambda *a, **kw: seen.append(1) or real(*a, **kw)
        with K.force_backend("blockwise"):
            fn(q, k, v).sum().backward()
    finally:
        K.blockwise.forward = real
    assert seen == [1]  # p = 1 would otherwise go to the fused CPU kernel
