"""Sigmoid attention's parity test: the forward and its gradients against its formula in float64, from the full weights.

    a_ij = sigmoid(s_ij + b),  b = -log n_i (n_i = keys query i sees) unless `bias` is set;  hidden keys: 0

`reference_weights` below is that formula, written from the paper (Ramapuram et al., 2024), not from retrofit's
code; tests/reference.py reads it from here, so the registry-driven tests (the patch matrix of every family, the
norm contract, convergence) compare the patched models with it too. Here: the kernel path the norm runs on, at
several shapes (GQA, more keys than queries as in a KV cache, one decode row, head sizes 64 and 80), under a
padding mask (bool and additive), a sliding window, soft-capping, in blocks of a few rows, with its gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

import retrofit
from retrofit.errors import RetrofitError
from retrofit.kernels import rowwise, weights_attention
from retrofit.norms import get_norm, make_options
from retrofit.norms.base import AttentionShape
from tests.kernels.test_kernels import left_padding, qkv
from tests.reference import window_mask
from tests.tiny import random_ids, tiny_model

SHAPES = [  # B, H, Hkv, Tq, Tk, D
    (2, 4, 2, 9, 9, 64),    # GQA, a prefill
    (1, 6, 3, 5, 13, 80),   # a chunk onto a cache, head size 80
    (2, 4, 4, 1, 12, 64),   # one decode row
]


def reference_weights(s, allowed, n, options, params):
    """float64 sigmoid(s + b) with b = options["bias"], or -log n where it is null (n: keys the row sees)."""
    bias = -torch.log(n.double()) if options.get("bias") is None else float(options["bias"])
    return 1.0 / (1.0 + torch.exp(-(s.double() + bias)))


def naive(q, k, v, bias, *, causal=True, mask=None, window=None, softcap=None):
    """(B, H, Tq, Dv) float64 from the full (Tq, Tk) weights."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    tq, tk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed = allowed & window_mask(tq, tk, tk + tq)
    if window:
        allowed = allowed & window_mask(tq, tk, window)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            allowed = allowed & (mask > torch.finfo(mask.dtype).min / 2)
            s = s + mask.double().masked_fill(~allowed, 0.0)
    allowed = allowed.expand(*s.shape)
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    w = torch.where(allowed, reference_weights(s, allowed, n, {"bias": bias}, {}), 0.0)
    return w @ v


def sigmoid_norm(heads: int, bias=None):
    cls = get_norm("sigmoid")
    return cls(make_options("sigmoid", bias=bias), AttentionShape(heads, heads, 8, None))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [None, -2.0])
@pytest.mark.parametrize("blocks", ["one", "few-rows"])
def test_forward_and_gradients_match_the_formula(one_thread, monkeypatch, shape, bias, blocks):
    if blocks == "few-rows":  # blocks of a row or two: the block edges must not change anything
        monkeypatch.setattr(rowwise, "BLOCK_ELEMS", 2 * shape[0] * shape[1] * shape[4])
    B, H, Hkv, Tq, Tk, D = shape
    q, k, v = (x.requires_grad_() for x in qkv(B=B, H=H, Hkv=Hkv, Tq=Tq, Tk=Tk, D=D, seed=Tq, spread=2.0))
    norm = sigmoid_norm(H, bias)
    out = weights_attention(q, k, v, norm.row_weights, causal=True, enable_gqa=Hkv != H)
    want = naive(q, k, v, bias)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    dout = torch.randn_like(want)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    ref = torch.autograd.grad((want * dout).sum(), (q, k, v))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_padding_mask_hides_keys_and_counts_only_visible_ones(one_thread, kind):
    """n is the keys a row sees: a left-padded row's b = -log(position + 1 - pads), not -log(position + 1)."""
    B, H, T = 2, 4, 10
    q, k, v = qkv(B=B, H=H, Tq=T, D=64, seed=3, spread=2.0)
    mask = left_padding(B, T, T, [0, 4], kind)
    out = weights_attention(q, k, v, sigmoid_norm(H).row_weights, causal=True, attn_mask=mask)
    torch.testing.assert_close(out.double(), naive(q, k, v, None, mask=mask), atol=2e-6, rtol=1e-5)
    # the padded row's last output equals the same tokens alone (what a left-padded batch must give)
    alone = weights_attention(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:], sigmoid_norm(H).row_weights, causal=True)
    torch.testing.assert_close(out[1:, :, 4:], alone, atol=2e-6, rtol=1e-5)


def test_window_and_softcap(one_thread):
    q, k, v = qkv(B=1, H=2, Tq=12, D=64, seed=5, spread=3.0)
    mask = window_mask(12, 12, 4)[None, None]
    out = weights_attention(q, k, v, sigmoid_norm(2).row_weights, causal=True, attn_mask=mask, softcap=5.0)
    torch.testing.assert_close(out.double(), naive(q, k, v, None, window=4, softcap=5.0), atol=2e-6, rtol=1e-5)


def test_blocks_stay_within_the_budget(one_thread, monkeypatch):
    """The formula sees a few rows of scores at a time, never the (Tq, Tk) matrix: memory O(T)."""
    monkeypatch.setattr(rowwise, "BLOCK_ELEMS", 4 * 2 * 64)
    seen = []

    def formula(s, visible, n):
        seen.append(tuple(s.shape))
        return torch.sigmoid(s - torch.log(n))

    q, k, v = (x.requires_grad_() for x in qkv(B=1, H=2, Tq=64, D=8, seed=1))
    out = weights_attention(q, k, v, formula, causal=True)
    assert max(r for _, _, r, _ in seen) == 4 and sum(r for _, _, r, _ in seen) == 64
    # the causal future skipped; the widest block first (rowwise.py: so the allocator reuses its memory)
    assert [keys for *_, keys in seen] == [min(64, r0 + 4) for r0 in reversed(range(0, 64, 4))]
    out.sum().backward()  # the backward recomputes each block (checkpointed): the formula runs once more per block
    assert len(seen) == 2 * 16 and q.grad.isfinite().all()


def test_the_norm_on_a_model_matches_a_fixed_bias_too():
    """A model patched with a fixed bias computes sigmoid(s + b) with that b (the registry's tests use the default)."""
    from tests.reference import reference_model

    original, patched = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(patched, "sigmoid", bias=-1.5)
    ids = random_ids()
    with torch.no_grad():
        want = reference_model(original, patched, nope=False)(ids).logits
        torch.testing.assert_close(patched(ids).logits, want, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(original(ids).logits, want, atol=1e-2)


@pytest.mark.parametrize("bad,match", [(float("nan"), "sigmoid bias must be finite"),
                                       (float("inf"), "sigmoid bias must be finite"),
                                       ("large", "option bias must be a number or null"),
                                       (True, "option bias must be a number or null")])
def test_a_bad_bias_is_one_line(bad, match):
    with pytest.raises(RetrofitError, match=match):
        make_options("sigmoid", bias=bad)


def test_vllm_refuses_it_in_one_line():
    from retrofit.serve.plan import serve_plan

    model = tiny_model("llama")
    retrofit.patch(model, "sigmoid")
    with pytest.raises(RetrofitError, match="sigmoid is not served by vLLM") as err:
        serve_plan({**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert "\n" not in str(err.value)
