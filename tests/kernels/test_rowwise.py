"""retrofit.kernels.weights_attention, the kernel of the norms that define only their weights (kernels/rowwise.py).

Its backward is written by hand around autograd on one block at a time (dq, dk, dv accumulated in place, the
formula's parameters' gradients summed over blocks, dropout's mask regenerated): torch.autograd.gradcheck checks it
against finite differences in float64, over GQA, a padding mask, blocks of a few rows, a learned per-head parameter
and dropout. The norm-level parity (sigmoid against its formula) is tests/norms/test_sigmoid.py.
"""

from __future__ import annotations

import pytest
import torch

from retrofit.kernels import rowwise, weights_attention
from tests.kernels.test_kernels import left_padding, qkv


def sigmoid_rows(bias):
    """sigmoid(s + b_h - log n) with a per-head b (H,): a formula with a parameter, as a norm's would read one."""
    return lambda s, visible, n: torch.sigmoid(s + bias.view(1, -1, 1, 1) - torch.log(n))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("few_rows", [False, True])
def test_gradients_match_finite_differences(one_thread, monkeypatch, masked, few_rows):
    if few_rows:  # blocks of a row or two: accumulation across blocks into dk, dv and the parameter
        monkeypatch.setattr(rowwise, "BLOCK_ELEMS", 2 * 2 * 4 * 7)
    q, k, v = (x.requires_grad_() for x in qkv(B=2, H=4, Hkv=2, Tq=5, Tk=7, D=8, dtype=torch.float64, seed=2))
    bias = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64).requires_grad_()
    mask = left_padding(2, 5, 7, [0, 3], "bool") if masked else None

    def run(q, k, v, bias):
        return weights_attention(q, k, v, sigmoid_rows(bias), (bias,), attn_mask=mask, enable_gqa=True)

    assert torch.autograd.gradcheck(run, (q, k, v, bias), eps=1e-6, atol=1e-6)


def test_dropout_mask_is_replayed_by_the_backward(one_thread, monkeypatch):
    """With dropout the forward is random, but the same seed gives the same mask; the backward must use it too."""
    monkeypatch.setattr(rowwise, "BLOCK_ELEMS", 2 * 2 * 9)
    q, k, v = (x.requires_grad_() for x in qkv(B=1, H=2, Tq=9, D=8, dtype=torch.float64, seed=4))
    bias = torch.zeros(2, dtype=torch.float64)

    def run(q, k, v):
        torch.manual_seed(0)
        return weights_attention(q, k, v, sigmoid_rows(bias), dropout_p=0.4)

    assert torch.autograd.gradcheck(run, (q, k, v), eps=1e-6, atol=1e-6)
    dropped, full = run(q, k, v), weights_attention(q, k, v, sigmoid_rows(bias))
    assert not torch.allclose(dropped, full)  # something was dropped
    torch.manual_seed(1)
    assert not torch.equal(weights_attention(q, k, v, sigmoid_rows(bias), dropout_p=0.4), dropped)  # a new seed


def test_no_graph_and_graph_give_the_same_output(one_thread):
    q, k, v = qkv(B=1, H=4, Hkv=1, Tq=6, Tk=6, D=16, seed=7)
    bias = torch.zeros(4)
    with torch.no_grad():
        plain = weights_attention(q, k, v, sigmoid_rows(bias), enable_gqa=True)
    graphed = weights_attention(q.requires_grad_(), k, v, sigmoid_rows(bias), enable_gqa=True)
    assert graphed.grad_fn is not None and torch.equal(plain, graphed.detach())


def test_bad_weights_is_one_line():
    q, k, v = qkv(B=1, H=2, Tq=3, D=8)
    with pytest.raises(ValueError, match="weights_attention: weights must be a function"):
        weights_attention(q, k, v, "sigmoid")
