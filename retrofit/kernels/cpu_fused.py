"""Softmax attention (p = 1) on CPU through PyTorch's fused flash kernel, with its log-sum-exp exposed.

    out, L = _scaled_dot_product_flash_attention_for_cpu(q, k, v)      L_i = log sum_j exp(s_ij)

The kernel never materializes T x T and returns L, but L has no autograd. So the caller's
autograd.Function saves (out, N) and calls `backward`, which runs the fused backward kernel with
*our* out and N. That kernel recomputes A = exp(s - N) and delta = rowsum(dO * out) from what it is
given, and returns dS = A * (dO v^T - delta) pushed through to dq, dk, dv. With N = L this is plain
softmax; with N = logaddexp(L, b) (softmax+1) and out = A v it is exactly softmax+1's gradient, since
dN/ds = A there too. (p != 1 needs dS = A dA - A^p delta, which this kernel cannot express: see
blockwise.py.)

Facts about the kernel (torch 2.13, checked in tests): it takes GQA (fewer kv heads) natively, an
additive float mask (fp32, or q's dtype) together with is_causal, strided views, and gives output 0
and L = 0 on a row whose mask is all -inf (our out and N are then 0 too, so gradients are 0). Its
is_causal is aligned top-left, so bottom-right causal with Tq != Tk goes through the mask, built one
block of query rows at a time (never T x T). Empty inputs (Tq or Tk = 0) crash it: the caller avoids them.
Its backward gives wrong gradients for a grad_out with zero strides (the expanded ones of out.sum()):
the caller passes dout.contiguous(). It has a dropout_p argument, but no way to hand the same mask
to the backward we call ourselves, so dropout goes to blockwise.py instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .masks import Rows, as_4d, block_bias, key_end

# Mask elements built per call (rows x keys x mask batch/heads): 4M fp32 = 16 MB.
MASK_ELEMS = 1 << 22
MIN_ROWS = 32


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _whole(Tq: int, Tk: int, causal: bool, mask) -> bool | None:
    """is_causal for a single call over all rows, or None when the rows must go in masked blocks."""
    if mask is not None:
        return None
    if not causal or Tq == 1:  # bottom-right: a single query sees every key
        return False
    return True if Tq == Tk else None  # top-left == bottom-right only when Tq == Tk


def _row_blocks(q, k, causal, mask):
    """Yield (r0, r1, end, bias): query rows r0:r1 see keys :end; bias (B', H', rows, end) fp32 or None."""
    Tq, Tk = q.shape[2], k.shape[2]
    mask4 = as_4d(mask)
    spread = 1 if mask4 is None else mask4.shape[0] * mask4.shape[1]
    rows = max(MIN_ROWS, MASK_ELEMS // (spread * Tk))
    for r0 in range(0, Tq, rows):
        r1 = min(r0 + rows, Tq)
        end = key_end(causal, r1, Tq, Tk)
        if end == 0:
            yield r0, r1, 0, None
            continue
        start, bias = block_bias(mask4, causal, Rows(r0, r1, Tq, Tk, end), q.device, torch.float32)
        if bias is not None:  # the kernel wants the bias over all `end` keys and its rows explicit
            bias = F.pad(bias, (start, 0)) if start > 0 else bias
            bias = bias.expand(*bias.shape[:2], r1 - r0, end)
            if q.dtype == torch.float64:
                bias = bias.double()
        yield r0, r1, end, bias


def forward(q, k, v, p: float, scale: float, causal: bool, mask):
    """p must be 1. out (B, H, Tq, D) in q's dtype and L (B, H, Tq), the row log-sum-exp (0 on empty rows)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, H, Tq, D = q.shape
    is_causal = _whole(Tq, k.shape[2], causal, mask)
    if is_causal is not None:
        return op(q, k, v, 0.0, is_causal, scale=scale)
    out = torch.zeros(B, H, Tq, D, dtype=q.dtype)
    lse = torch.zeros(B, H, Tq, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for r0, r1, end, bias in _row_blocks(q, k, causal, mask):
        if end == 0:
            continue  # no visible key: out 0, L 0
        out[:, :, r0:r1], lse[:, :, r0:r1] = op(q[:, :, r0:r1], k[:, :, :end], v[:, :, :end], 0.0, False,
                                                attn_mask=bias, scale=scale)
    return out, lse


def backward(dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask):
    """(dq, dk, dv) for out = A v, A = exp(s - norm), as in the module docstring (PyTorch's kernel writes dq in q's
    dtype)."""
    bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    dout = dout.to(q.dtype)
    is_causal = _whole(q.shape[2], k.shape[2], causal, mask)
    if is_causal is not None:
        return bop(dout, q, k, v, out, norm, 0.0, is_causal, scale=scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # dk, dv summed over row blocks
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=acc)
    dv = torch.zeros(v.shape, dtype=acc)
    for r0, r1, end, bias in _row_blocks(q, k, causal, mask):
        if end == 0:
            continue
        dq_blk, dk_blk, dv_blk = bop(dout[:, :, r0:r1], q[:, :, r0:r1], k[:, :, :end], v[:, :, :end],
                                     out[:, :, r0:r1], norm[:, :, r0:r1], 0.0, False, attn_mask=bias, scale=scale)
        dq[:, :, r0:r1] = dq_blk
        dk[:, :, :end] += dk_blk
        dv[:, :, :end] += dv_blk
    return dq, dk.to(k.dtype), dv.to(v.dtype)
