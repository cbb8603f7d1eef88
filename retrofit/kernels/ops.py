"""The kernels as torch.library custom ops, so torch.compile sees one opaque node per attention call.

    out, norm = torch.ops.retrofit.attention(q, k, v, sink, mask, seed, p, scale, causal, backend, softcap,
                                             dropout_p)
    dq, dk, dv = torch.ops.retrofit.attention_backward(dout, q, k, v, out, norm, mask, seed, p, scale, causal,
                                                       backend, softcap, dropout_p)

One op serves p-softmax (any p), SSMax's softmax call (p = 1 on the scaled q) and softmax+1 (p = 1 with a
`sink`, b_h per head: N -> logaddexp(N, b_h)); `backend` names the backend `dispatch.choose` picked, so
the backward runs the one the forward ran. `seed` (a 0-d int64 tensor, or None without dropout) seeds the
dropout mask. Both ops have fake (meta) implementations and the forward a registered autograd formula:
Dynamo traces through them with no graph break (`fullgraph=True`), and `torch.library.opcheck` checks them.

`attention` below is what retrofit.kernels calls: the op whenever a gradient may be needed or Dynamo is
tracing, otherwise the implementation directly (a decode step under no_grad skips the op's dispatch,
~10 us per call measured here).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import blockwise, dispatch


def _extra(seed, softcap, dropout_p) -> dict:
    extra = {}
    if dropout_p > 0:
        extra["dropout"] = blockwise.Dropout(dropout_p, int(seed))
    if softcap is not None:  # only blockwise and decode take it (dispatch.choose)
        extra["softcap"] = softcap
    return extra


def forward_impl(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], mask: Optional[Tensor],
                 seed: Optional[Tensor], p: float, scale: float, causal: bool, backend: str,
                 softcap: Optional[float], dropout_p: float) -> tuple[Tensor, Tensor]:
    """out (B, H, Tq, Dv) in q's dtype and N (B, H, Tq) fp32 (fp64 for fp64 inputs), both contiguous."""
    with dispatch.no_autocast(q.device.type):
        out, norm = dispatch.module(backend).forward(q, k, v, p, scale, causal, mask, **_extra(seed, softcap,
                                                                                               dropout_p))
        if sink is not None:  # softmax+1: sum exp(s) -> exp(b_h) + sum exp(s), i.e. N -> logaddexp(N, b_h)
            with_sink = torch.logaddexp(norm, sink.to(norm.dtype).view(1, -1, 1))
            rescale = torch.exp(norm - with_sink).unsqueeze(-1)  # sigmoid(LSE - b_h), (B, H, Tq, 1)
            out = out.mul_(rescale) if out.dtype == rescale.dtype else (out.to(rescale.dtype) * rescale).to(q.dtype)
            norm = with_sink
    return out.contiguous(), norm.contiguous()  # the fused CPU kernel's LSE is (B, Tq, H) in memory


@torch.library.custom_op("retrofit::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], mask: Optional[Tensor],
                 seed: Optional[Tensor], p: float, scale: float, causal: bool, backend: str,
                 softcap: Optional[float], dropout_p: float) -> tuple[Tensor, Tensor]:
    return forward_impl(q, k, v, sink, mask, seed, p, scale, causal, backend, softcap, dropout_p)


@attention_op.register_fake
def _attention_fake(q, k, v, sink, mask, seed, p, scale, causal, backend, softcap, dropout_p):
    B, H, Tq, _ = q.shape
    norm_dtype = blockwise.compute_dtype(q.dtype)
    return q.new_empty(B, H, Tq, v.shape[-1]), q.new_empty(B, H, Tq, dtype=norm_dtype)


@torch.library.custom_op("retrofit::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, norm: Tensor,
                          mask: Optional[Tensor], seed: Optional[Tensor], p: float, scale: float, causal: bool,
                          backend: str, softcap: Optional[float], dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of sum(dout * out), each in its input's dtype."""
    with dispatch.no_autocast(q.device.type):  # backward may run inside autocast too
        # contiguous: the fused CPU backward is wrong for a dout with zero strides (cpu_fused.py)
        grads = dispatch.module(backend).backward(dout.contiguous(), q, k, v, out, norm, p, scale, causal, mask,
                                                  **_extra(seed, softcap, dropout_p))
    return tuple(g.contiguous() for g in grads)


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, norm, mask, seed, p, scale, causal, backend, softcap, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, sink, mask, seed, *args = inputs
    out, norm = output
    ctx.save_for_backward(q, k, v, out, norm, sink, mask, seed)
    ctx.args = args  # p, scale, causal, backend, softcap, dropout_p
    ctx.mark_non_differentiable(norm)


def _backward(ctx, dout, _dnorm):
    q, k, v, out, norm, sink, mask, seed = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, norm, mask, seed, *ctx.args)
    dsink = None
    if sink is not None and ctx.needs_input_grad[3]:
        # dN/db_h = exp(b_h - N_i) and d out_i/dN_i = -out_i:  dL/db_h = -sum_{b,i} exp(b_h - N_i) dO_i . out_i
        delta = (dout.to(norm.dtype) * out.to(norm.dtype)).sum(-1)  # (B, H, Tq)
        weight = torch.exp(sink.to(norm.dtype).view(1, -1, 1) - norm)
        dsink = -(weight * delta).sum((0, 2)).to(sink.dtype)
    return dq, dk, dv, dsink, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, sink, mask, seed, p: float, scale: float, causal: bool, backend: str, softcap,
              dropout_p: float) -> Tensor:
    """out (B, H, Tq, Dv) in q's dtype: through the op, or straight to the implementation when no graph
    (autograd's or Dynamo's) will see the call."""
    args = (q, k, v, sink, mask, seed, p, scale, causal, backend, softcap, dropout_p)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, sink))):
        return attention_op(*args)[0]
    return forward_impl(*args)[0]
