"""The kernels as torch.library custom ops, so torch.compile sees one opaque node per attention call.

    out, norm = torch.ops.retrofit.attention(q, k, v, sink, mask, seed, q_scale, p, scale, causal, backend,
                                             softcap, dropout_p)
    dq, dk, dv = torch.ops.retrofit.attention_backward(dout, q, k, v, out, norm, mask, seed, q_scale, p, scale,
                                                       causal, backend, softcap, dropout_p)

One op serves p-softmax (any p), SSMax (p = 1 with a `q_scale`) and softmax+1 (p = 1 with a `sink`, b_h per
head: N -> logaddexp(N, b_h)); `backend` names the backend `dispatch.choose` picked, so the backward runs the
one the forward ran. SSMax's `q_scale` (s_h log n_i, fp32, (B or 1, H, Tq)) scales q inside the op, rounded once
to k's dtype, and its gradient is the one the kernels' rounding hurts: ds_h = sum_i log n_i q_i . dq'_i cancels
almost to nothing, so bf16 roundings that the other gradients shrug off show in it (0.045 relative on the H100,
docs/results/gpu-h100/). Two of them are avoidable: the backward asks its backend for dq' in fp32 (`dq_dtype`;
autograd outside the op would round it to q's bf16), and the backends that accumulate in fp32 (WIDE_OUT) return
out in fp32, so the backward's delta = rowsum(dO * out) is not taken from a rounded out (the larger of the two:
0.015 -> 0.003 on the CPU, bf16, bool mask). SSMax's out is cast to the compute dtype after the op.

`seed` (a 0-d int64 tensor, or None without dropout) seeds the dropout mask. Both ops have fake (meta)
implementations and the forward a registered autograd formula: Dynamo traces through them with no graph break
(`fullgraph=True`), and `torch.library.opcheck` checks them.

`attention` below is what retrofit.kernels calls: the op whenever a gradient may be needed or Dynamo is
tracing, otherwise the implementation directly (a decode step under no_grad skips the op's dispatch,
~10 us per call measured here).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import blockwise, dispatch

WIDE_OUT = ("blockwise", "decode", "triton")  # backends that can hand back an unrounded (fp32) out for SSMax
# Backends return dq in the precision they accumulate it in where that costs nothing (blockwise, decode, p-softmax's
# flash composition) and the op rounds it; Triton writes it from the kernel, in fp32 only when asked (dq_dtype).
ASKS_DQ_DTYPE = ("triton",)


def scaled_query(q: Tensor, q_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """q * q_scale per row (SSMax's s_h log n_i), computed in q_scale's (wide) dtype and rounded once to `dtype`."""
    return (q.to(q_scale.dtype) * q_scale.unsqueeze(-1)).to(dtype)


def _extra(seed, softcap, dropout_p) -> dict:
    extra = {}
    if dropout_p > 0:
        extra["dropout"] = blockwise.Dropout(dropout_p, int(seed))
    if softcap is not None:  # only blockwise and decode take it (dispatch.choose)
        extra["softcap"] = softcap
    return extra


def forward_impl(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], mask: Optional[Tensor],
                 seed: Optional[Tensor], q_scale: Optional[Tensor], *options) -> tuple[Tensor, Tensor]:
    """The op's implementation; options: (p, scale, causal, backend, softcap, dropout_p), as the op's schema.
    out (B, H, Tq, Dv) in k's dtype (the compute dtype; with q_scale on a WIDE_OUT backend, q_scale's) and N
    (B, H, Tq) fp32 (fp64 for fp64 inputs), both contiguous. q is in k's dtype too, except with q_scale (then any
    dtype: it is scaled and rounded here)."""
    p, scale, causal, backend, softcap, dropout_p = options
    extra = _extra(seed, softcap, dropout_p)
    if q_scale is not None:
        q = scaled_query(q, q_scale, k.dtype)
        if backend in WIDE_OUT:
            extra["out_dtype"] = q_scale.dtype
    with dispatch.no_autocast(q.device.type):
        out, norm = dispatch.module(backend).forward(q, k, v, p, scale, causal, mask, **extra)
        if sink is not None:  # softmax+1: sum exp(s) -> exp(b_h) + sum exp(s), i.e. N -> logaddexp(N, b_h)
            with_sink = torch.logaddexp(norm, sink.to(norm.dtype).view(1, -1, 1))
            rescale = torch.exp(norm - with_sink).unsqueeze(-1)  # sigmoid(LSE - b_h), (B, H, Tq, 1)
            out = out.mul_(rescale) if out.dtype == rescale.dtype else (out.to(rescale.dtype) * rescale).to(q.dtype)
            norm = with_sink
    return out.contiguous(), norm.contiguous()  # the fused CPU kernel's LSE is (B, Tq, H) in memory


@torch.library.custom_op("retrofit::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], mask: Optional[Tensor],
                 seed: Optional[Tensor], q_scale: Optional[Tensor], p: float, scale: float, causal: bool,
                 backend: str, softcap: Optional[float], dropout_p: float) -> tuple[Tensor, Tensor]:
    return forward_impl(q, k, v, sink, mask, seed, q_scale, p, scale, causal, backend, softcap, dropout_p)


@attention_op.register_fake
def _attention_fake(q, k, v, sink, mask, seed, q_scale, p, scale, causal, backend, softcap, dropout_p):
    B, H, Tq, _ = q.shape
    norm_dtype = blockwise.compute_dtype(k.dtype)
    out_dtype = q_scale.dtype if q_scale is not None and backend in WIDE_OUT else k.dtype
    return k.new_empty(B, H, Tq, v.shape[-1], dtype=out_dtype), k.new_empty(B, H, Tq, dtype=norm_dtype)


@torch.library.custom_op("retrofit::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, norm: Tensor,
                          mask: Optional[Tensor], seed: Optional[Tensor], q_scale: Optional[Tensor], p: float,
                          scale: float, causal: bool, backend: str, softcap: Optional[float],
                          dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of sum(dout * out), dk and dv in their inputs' dtypes; dq in q's dtype, except with q_scale:
    then the gradient of the scaled q, in the wide dtype (fp32; fp64 for fp64), for the chain rule in _backward."""
    dq_dtype = None
    if q_scale is not None:
        q, dq_dtype = scaled_query(q, q_scale, k.dtype), q_scale.dtype
    with dispatch.no_autocast(q.device.type):  # backward may run inside autocast too
        # contiguous: the fused CPU backward is wrong for a dout with zero strides (cpu_fused.py)
        wide = {"dq_dtype": dq_dtype} if dq_dtype is not None and backend in ASKS_DQ_DTYPE else {}
        dq, dk, dv = dispatch.module(backend).backward(dout.contiguous(), q, k, v, out, norm, p, scale, causal, mask,
                                                       **wide, **_extra(seed, softcap, dropout_p))
    return dq.to(dq_dtype or q.dtype).contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, norm, mask, seed, q_scale, p, scale, causal, backend, softcap,
                             dropout_p):
    dq_dtype = q.dtype if q_scale is None else q_scale.dtype
    return q.new_empty(q.shape, dtype=dq_dtype), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, sink, mask, seed, q_scale, *args = inputs
    out, norm = output
    ctx.save_for_backward(q, k, v, out, norm, sink, mask, seed, q_scale)
    ctx.args = args  # p, scale, causal, backend, softcap, dropout_p
    ctx.mark_non_differentiable(norm)


def _backward(ctx, dout, _dnorm):
    q, k, v, out, norm, sink, mask, seed, q_scale = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, norm, mask, seed, q_scale, *ctx.args)
    dsink = dscale = None
    if sink is not None and ctx.needs_input_grad[3]:
        # dN/db_h = exp(b_h - N_i) and d out_i/dN_i = -out_i:  dL/db_h = -sum_{b,i} exp(b_h - N_i) dO_i . out_i
        delta = (dout.to(norm.dtype) * out.to(norm.dtype)).sum(-1)  # (B, H, Tq)
        weight = torch.exp(sink.to(norm.dtype).view(1, -1, 1) - norm)
        dsink = -(weight * delta).sum((0, 2)).to(sink.dtype)
    if q_scale is not None:  # dq is the wide gradient of q * q_scale: the chain rule, in the wide dtype
        if ctx.needs_input_grad[6]:
            dscale = (dq * q.to(dq.dtype)).sum(-1).sum_to_size(q_scale.shape)
        dq = (dq * q_scale.unsqueeze(-1)).to(q.dtype)
    return dq, dk, dv, dsink, None, None, dscale, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, sink, mask, seed, q_scale, *options) -> Tensor:
    """out (B, H, Tq, Dv) in k's dtype: through the op, or straight to the implementation when no graph
    (autograd's or Dynamo's) will see the call. options: (p, scale, causal, backend, softcap, dropout_p)."""
    args = (q, k, v, sink, mask, seed, q_scale, *options)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, sink, q_scale))):
        return attention_op(*args)[0]
    return forward_impl(*args)[0]
