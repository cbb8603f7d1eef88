"""Exact, memory-efficient attention for the norms that change the weights: p-softmax, Scalable-Softmax, softmax+1.

    out = psoftmax_attention(q, k, v, p=2.0)            # weights exp(s) / ||exp(s)||_p
    out = ssmax_attention(q, k, v, s_param)             # logits * s_h * log(n), n = visible keys
    out = softmax1_attention(q, k, v, sink)             # weights exp(s) / (exp(b_h) + sum exp(s))

All take SDPA's conventions: q (B, H, Tq, D), k/v (B, Hkv, Tk, D); out (B, H, Tq, D) in v's dtype;
`causal` aligns bottom-right (queries are the last Tq of the Tk positions, as with a KV cache);
`attn_mask` is bool (True = attend) or additive float (hidden = dtype min or -inf), broadcastable to
(B, H, Tq, Tk), and may be combined with `causal`; with `enable_gqa`, query head h uses kv head
h // (H // Hkv). A row with no visible key gives 0 and zero (finite) gradients.

Every kernel computes out_i = sum_j exp(s_ij - N_i) v_j for a row normalizer N, never with a T x T
tensor (memory O(T) forward and backward), accumulating in fp32 for fp16/bf16. Backends, per call:
  triton_psoftmax  CUDA with Triton importable: one fused flash-style kernel, forward and backward.
  cpu_fused        CPU, p = 1 (softmax, ssmax, softmax+1): PyTorch's fused flash kernel + its LSE.
  blockwise        everything else (any p, any device): bounded blocks of plain PyTorch ops, on CPU
                   shared out to torch.get_num_threads() worker threads (see blockwise.py for why).
Softmax+1 is softmax with N = logaddexp(LSE, b_h), i.e. out = softmax_out * sigmoid(LSE - b_h); its
gradient flows to q, k, v and the sink through the same backward (see cpu_fused.py).

Mixed floating dtypes (bf16 autocast: Llama-family RoPE hands back q, k in fp32 and v in bf16) are
accepted as SDPA accepts them: all three are upcast to the widest, computed as usual (fp32
accumulation), and out is returned in v's dtype (what the output projection then reads); each
gradient comes back in its input's dtype. Autocast is switched off inside the kernels, forward and
backward: it would otherwise round the blockwise matmuls to bf16 on the calling thread only (the
worker threads do not inherit it), and the fp32 accumulation promised above would not hold.

`softcap` c (Gemma 2's attn_logit_softcapping) caps the scaled logits before the mask and the
normalization, s -> c * tanh(s / c), forward and backward (ds_raw = ds_capped * (1 - tanh^2(s / c))).
Only the blockwise backend implements it: PyTorch's fused CPU kernel cannot cap, and the Triton
kernel does not, so soft-capped calls are routed to blockwise (see softcap.py for the formulas).

`dropout_p` (as SDPA's; pass 0 outside training) drops attention weights after normalization. It
runs on the blockwise backend, which regenerates the mask in the backward from a seed drawn from
torch's default generator (so torch.manual_seed and activation checkpointing reproduce it).
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import blockwise, cpu_fused
from .masks import causal_mask, combine_causal, visible_counts
from .softcap import check_softcap

# None = pick per call; "blockwise" / "cpu_fused" / "triton" force one (tests and benchmarks).
FORCE_BACKEND: str | None = None
_TRITON_UNSET = object()
_triton = _TRITON_UNSET


def triton_backend():
    """retrofit.kernels.triton_psoftmax when Triton imports, else None (importing retrofit never needs Triton)."""
    global _triton
    if _triton is _TRITON_UNSET:
        try:
            from . import triton_psoftmax
            _triton = triton_psoftmax if triton_psoftmax.AVAILABLE else None
        except Exception:  # a broken Triton install must not break the CPU path
            _triton = None
    return _triton


def _backend(q, k, v, p: float, mask, dropout, softcap):
    if dropout is not None or softcap is not None:  # the one backend with dropout in its backward, and softcap
        return blockwise
    if FORCE_BACKEND is not None:
        return {"blockwise": blockwise, "cpu_fused": cpu_fused, "triton": triton_backend()}[FORCE_BACKEND]
    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing to attend: blockwise returns zeros (fused CPU op crashes)
        return blockwise
    if q.is_cuda and triton_backend() is not None and triton_backend().supports(q, v, mask):
        return triton_backend()
    if p == 1.0 and cpu_fused.available(q, v):
        return cpu_fused
    return blockwise


class _Attention(torch.autograd.Function):
    """out = A v with A = exp(s - N); N from the backend's p-normalizer, or logaddexp(LSE, sink) for softmax+1."""

    @staticmethod
    def forward(ctx, q, k, v, sink, p, scale, causal, mask, backend, dropout, softcap):
        extra = {"dropout": dropout} if dropout is not None else {}
        if softcap is not None:  # only blockwise takes it (see _backend)
            extra["softcap"] = softcap
        out, norm = backend.forward(q, k, v, p, scale, causal, mask, **extra)  # (B, H, Tq, Dv), (B, H, Tq); ours
        if sink is not None:  # softmax+1: sum exp(s) -> exp(b_h) + sum exp(s), i.e. N -> logaddexp(N, b_h)
            with_sink = torch.logaddexp(norm, sink.detach().to(norm.dtype).view(1, -1, 1))
            rescale = torch.exp(norm - with_sink).unsqueeze(-1)  # sigmoid(LSE - b_h), (B, H, Tq, 1)
            out = out.mul_(rescale) if out.dtype == rescale.dtype else (out.to(rescale.dtype) * rescale).to(q.dtype)
            norm = with_sink
        ctx.save_for_backward(q, k, v, out, norm, sink)
        ctx.args = (p, scale, causal, mask, backend, extra)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, norm, sink = ctx.saved_tensors
        p, scale, causal, mask, backend, extra = ctx.args
        with _no_autocast(q.device.type):  # backward may be called inside autocast too
            dq, dk, dv = backend.backward(dout.contiguous(), q, k, v, out, norm, p, scale, causal, mask, **extra)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            # dN/db_h = exp(b_h - N_i) and d out_i/dN_i = -out_i:  dL/db_h = -sum_{b,i} exp(b_h - N_i) dO_i . out_i
            delta = (dout.to(norm.dtype) * out.to(norm.dtype)).sum(-1)  # (B, H, Tq)
            weight = torch.exp(sink.detach().to(norm.dtype).view(1, -1, 1) - norm)
            dsink = -(weight * delta).sum((0, 2)).to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None


def _check(q, k, v, attn_mask, enable_gqa, name):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{name}: q, k, v must be (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"{name}: q, k, v must be floating-point tensors; got {q.dtype}, {k.dtype}, {v.dtype}")
    (B, H, Tq, D), (Bk, Hkv, Tk, Dk) = q.shape, k.shape
    if Bk != B or v.shape[:3] != k.shape[:3] or Dk != D:
        raise ValueError(f"{name}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv != H and not enable_gqa:
        raise ValueError(f"{name}: q has {H} heads and k {Hkv}: pass enable_gqa=True for grouped-query attention")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{name}: {H} query heads cannot share {Hkv} kv heads evenly")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"{name}: attn_mask must be bool (True = attend) or additive float; got {attn_mask.dtype}")
        want = (B, H, Tq, Tk)
        got = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        if len(got) != 4 or any(g not in (1, w) for g, w in zip(got, want)):
            raise ValueError(f"{name}: attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, H, Tq, Tk) "
                             f"= {want}")


def _no_autocast(device_type: str):
    """Autocast off for this device if it is on (a no-op context elsewhere, e.g. on devices autocast lacks)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if on else contextlib.nullcontext()


def _widest(q, k, v) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def _attention(q, k, v, p, sink, scale, causal, attn_mask, dropout_p, softcap):
    """out (B, H, Tq, Dv) in v's dtype; q, k, v of mixed dtypes are upcast first (autograd casts each grad back)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    wide = _widest(q, k, v)
    out_dtype = v.dtype
    q, k, v = q.to(wide), k.to(wide), v.to(wide)  # no-ops (no copy, no graph node) when they already agree
    dropout = blockwise.Dropout(dropout_p, int(torch.randint(2 ** 62, ()).item())) if dropout_p > 0 else None
    backend = _backend(q, k, v, p, attn_mask, dropout, softcap)
    with _no_autocast(q.device.type):  # the kernels choose their own precision (module docstring)
        out = _Attention.apply(q, k, v, sink, p, scale, bool(causal), attn_mask, backend, dropout, softcap)
    return out.to(out_dtype)


def psoftmax_attention(q, k, v, p=2.0, *, scale=None, causal=True, attn_mask=None, enable_gqa=False, dropout_p=0.0,
                       softcap=None):
    """p-softmax attention: weights exp(s) / ||exp(s)||_p over the visible keys (p = 1: softmax).

    Equivalently A = exp(s - LSE(p s) / p): a row of A has unit p-norm, so its entries are not a
    distribution for p > 1 (their sum grows with the number of comparable keys). With `softcap` c,
    s = c * tanh(scale * q.k / c) (+ mask).
    """
    _check(q, k, v, attn_mask, enable_gqa, "psoftmax_attention")
    p = float(p)
    if not p > 0 or math.isinf(p):
        raise ValueError(f"psoftmax_attention: p must be a finite number > 0; got {p}")
    softcap = check_softcap(softcap, "psoftmax_attention")
    return _attention(q, k, v, p, None, scale, causal, attn_mask, dropout_p, softcap)


def ssmax_attention(q, k, v, s_param, *, scale=None, causal=True, attn_mask=None, enable_gqa=False, dropout_p=0.0,
                    softcap=None):
    """Scalable-Softmax: softmax of logits times s_h * log(n_i), n_i = keys query i may see (visible_counts).

    A per-query, per-head scaling of q, then softmax attention: q'_hi = q_hi * s_h * log(n_i). The
    scaling is ordinary autograd (gradient to q and s_param); fp16/bf16 inputs run in fp32. n_i counts
    what the mask leaves visible, so under a sliding window of W keys it is min(position + 1, W).
    With `softcap` c the scaling comes first, then the cap: c * tanh(s_h log(n_i) * scale * q.k / c),
    as a model whose query SSMax scaled would compute it.
    """
    _check(q, k, v, attn_mask, enable_gqa, "ssmax_attention")
    H, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    if s_param.numel() != H:
        raise ValueError(f"ssmax_attention: s_param must have one value per query head ({H}); "
                         f"got {tuple(s_param.shape)}")
    softcap = check_softcap(softcap, "ssmax_attention")
    ct = blockwise.compute_dtype(_widest(q, k, v))
    n = visible_counts(attn_mask, causal, Tq, Tk, q.device)  # broadcastable to (B, H, Tq), >= 1
    factor = s_param.to(ct).view(H, 1) * torch.log(n.to(ct))  # (.., H, Tq)
    q_scaled = q.to(ct) * factor.unsqueeze(-1)  # (B, H, Tq, D)
    out = _attention(q_scaled, k.to(ct), v.to(ct), 1.0, None, scale, causal, attn_mask, dropout_p, softcap)
    return out.to(v.dtype)


def softmax1_attention(q, k, v, sink, *, scale=None, causal=True, attn_mask=None, enable_gqa=False, dropout_p=0.0,
                       softcap=None):
    """softmax+1 with a learned sink: weights exp(s) / (exp(b_h) + sum exp(s)); b_h = sink[h] (b = 0: softmax+1).

    out = softmax_out * sigmoid(LSE - b_h): attention may put mass on "nothing" (the sink), so a row
    can sum to less than 1. Gradients reach q, k, v and the sink. `softcap` caps the key logits s only;
    the sink b_h is a logit of its own and is not capped.
    """
    _check(q, k, v, attn_mask, enable_gqa, "softmax1_attention")
    if sink.numel() != q.shape[1]:
        raise ValueError(f"softmax1_attention: sink must have one value per query head ({q.shape[1]}); "
                         f"got {tuple(sink.shape)}")
    softcap = check_softcap(softcap, "softmax1_attention")
    return _attention(q, k, v, 1.0, sink.reshape(-1), scale, causal, attn_mask, dropout_p, softcap)


__all__ = ["psoftmax_attention", "ssmax_attention", "softmax1_attention", "visible_counts", "causal_mask",
           "combine_causal", "triton_backend", "FORCE_BACKEND"]
