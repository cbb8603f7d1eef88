"""Exact, memory-efficient attention for the norms that change the weights: p-softmax, Scalable-Softmax, softmax+1,
and any norm that defines only its weights.

    out = psoftmax_attention(q, k, v, p=2.0)            # weights exp(s) / ||exp(s)||_p
    out = ssmax_attention(q, k, v, s_param)             # logits * s_h * log(n), n = visible keys
    out = softmax1_attention(q, k, v, sink)             # weights exp(s) / (exp(b_h) + sum exp(s))
    out = weights_attention(q, k, v, fn)                # weights fn(s, visible, n), row blocks (rowwise.py)

All take SDPA's conventions: q (B, H, Tq, D), k/v (B, Hkv, Tk, D); out (B, H, Tq, D);
`causal` aligns bottom-right (queries are the last Tq of the Tk positions, as with a KV cache);
`attn_mask` is bool (True = attend) or additive float (hidden = dtype min or -inf), broadcastable to
(B, H, Tq, Tk), and may be combined with `causal`; with `enable_gqa`, query head h uses kv head
h // (H // Hkv). A row with no visible key gives 0 and zero (finite) gradients.

`weights_attention` is apart from what follows: a row-wise function's weights on blocks of rows, with no backend
choice and no custom op (rowwise.py). The other three compute out_i = sum_j exp(s_ij - N_i) v_j for a row normalizer
N, never with a T x T tensor (memory O(T) forward and backward), accumulating in fp32 for fp16/bf16. Backends, chosen
per call in this order (dispatch.py):
  blockwise        calls with dropout: bounded blocks of plain PyTorch ops (any p, any device), on CPU
                   shared out to torch.get_num_threads() worker threads (see blockwise.py for why).
  decode           a few query rows (Tq <= 16, KV-cache decoding), any p, any device: the scores of
                   those rows directly, two matmuls and a few elementwise ops (decode.py); except
                   softmax (p = 1) on CPU, which the fused CPU kernel below computes faster.
  CUDA             the first of dispatch.CUDA_ORDER[norm] that takes the call: cuda_flash (PyTorch's fused flash
                   kernel and its LSE, cuda_fused.py) for softmax, SSMax and softmax+1, else triton_psoftmax (Triton
                   importable: one fused flash-style kernel, forward and backward), which p-softmax tries first.
  cpu_fused        CPU, p = 1 (softmax, ssmax, softmax+1): PyTorch's fused flash kernel + its LSE.
  blockwise        everything else.
`force_backend(name)` (a context manager; tests and benchmarks) routes the calls inside it to one backend (flex.py
and cuda_fused.py's efficient and cudnn kernels run only when forced);
one that cannot compute a call raises ValueError (the fused CPU kernel with p != 1, Triton without CUDA
or its interpreter). Softmax+1 is softmax with N = logaddexp(LSE, b_h), i.e. out = softmax_out *
sigmoid(LSE - b_h); its gradient flows to q, k, v and the sink through the same backward (custom_ops.py).

Every call of those three goes through one torch.library custom op, retrofit::attention, with a fake implementation
and a registered backward op (custom_ops.py): torch.compile(fullgraph=True) traces the norms with no graph break.
Without a graph to record (no_grad, inference), the implementation is called directly, skipping the op's dispatch.

Dtypes as SDPA. Under autocast (for q's device), q, k and v are cast to the autocast dtype
(torch.get_autocast_dtype) and computed in it, with fp32 accumulation; out is in that dtype. So bf16
training runs the Triton kernel's bf16 tensor-core path and the fused CPU kernel's bf16 path; blockwise
and decode compute bf16 inputs in fp32 explicitly (blockwise's worker threads do not inherit autocast
anyway). Outside autocast, mixed dtypes (Llama-family RoPE hands back q, k in fp32 and v in bf16) are
upcast to the widest, and out is returned in v's dtype. Either way each gradient comes back in its
input's dtype, and autocast is off inside the kernels, forward and backward (they choose their own
precision). SSMax scales q (in fp32, rounded once to the compute dtype) and passes k and v on as they are.

`softcap` c (Gemma 2's attn_logit_softcapping) caps the scaled logits before the mask and the
normalization, s -> c * tanh(s / c), forward and backward (ds_raw = ds_capped * (1 - tanh^2(s / c))).
The blockwise and decode backends implement it: PyTorch's fused CPU kernel cannot cap, and the Triton
kernel does not, so soft-capped calls with many query rows go to blockwise (see softcap.py).

`dropout_p` (as SDPA's; pass 0 outside training) drops attention weights after normalization. It
runs on the blockwise backend, which regenerates the mask in the backward from a seed drawn from
torch's default generator (so torch.manual_seed and activation checkpointing reproduce it).
"""

from __future__ import annotations

import math

import torch

from . import blockwise, cpu_fused, custom_ops, decode, dispatch, flex, rowwise  # noqa: F401  (the backends, for tests and benchmarks)
from .dispatch import autocast_on, force_backend, triton_backend
from .dispatch import choose as _choose
from .dispatch import compute_dtype as _compute_dtype
from .masks import causal_mask, visible_counts
from .softcap import check_softcap


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


def _attention(q, k, v, norm, p, sink, scale, causal, attn_mask, dropout_p, softcap, q_scale=None):
    """out (B, H, Tq, Dv): q, k, v go to the compute dtype first (dispatch.compute_dtype; autograd casts each
    gradient back to its input's dtype), then to the backend dispatch.choose picks for `norm`, through the custom
    op. With `q_scale` (SSMax's per-row factor, fp32) q goes as it is: the op scales it and rounds it once."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    wide = _compute_dtype(q, k, v)
    out_dtype = wide if autocast_on(q.device.type) else v.dtype  # SDPA's: autocast's dtype, else v's
    k, v = k.to(wide), v.to(wide)  # no-ops (no copy, no graph node) when they already agree
    q = q.to(wide) if q_scale is None else q
    seed = torch.randint(2 ** 62, (), device="cpu") if dropout_p > 0 else None  # the dropout mask's seed
    as_computed = q if q_scale is None else torch.empty((), dtype=wide, device=q.device).expand(q.shape)
    backend = _choose(as_computed, k, v, p, attn_mask, dropout_p > 0, softcap, bool(causal), norm)
    if backend == "flex":  # differentiable and traceable by itself: no custom op around it (flex.py)
        if q_scale is not None:
            q = custom_ops.scaled_query(q, q_scale, wide)
        with dispatch.no_autocast(q.device.type):
            return flex.attention(q, k, v, sink, p, scale, bool(causal)).to(out_dtype)
    out = custom_ops.attention(q, k, v, sink, attn_mask, seed, q_scale, p, scale, bool(causal), backend, softcap,
                               dropout_p)
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
    return _attention(q, k, v, "psoftmax" if p != 1.0 else "softmax", p, None, scale, causal, attn_mask, dropout_p,
                      softcap)


def ssmax_attention(q, k, v, s_param, *, scale=None, causal=True, attn_mask=None, enable_gqa=False, dropout_p=0.0,
                    softcap=None):
    """Scalable-Softmax: softmax of logits times s_h * log(n_i), n_i = keys query i may see (visible_counts).

    A per-query, per-head scaling of q, then softmax attention: q'_hi = q_hi * s_h * log(n_i), computed in fp32
    and rounded once to the compute dtype inside the kernel op, whose backward takes the gradient of q' in fp32
    through the chain rule to q and s_param (the gradient of s sums fp32 terms, not bf16-rounded ones). n_i counts
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
    target = _compute_dtype(q, k, v)  # the kernel's dtype; k and v go on as they are (no fp32 copies)
    n = visible_counts(attn_mask, causal, Tq, Tk, q.device)  # broadcastable to (B, H, Tq), >= 1
    wide = blockwise.compute_dtype(target)  # fp32 (fp64 for fp64): q * factor is rounded to target once
    factor = s_param.to(wide).view(H, 1) * torch.log(n.to(wide))  # (.., H, Tq)
    q_scale = (factor if factor.dim() == 3 else factor.unsqueeze(0)).contiguous()  # (B or 1, H, Tq)
    # q * q_scale is formed inside the kernel op (custom_ops.py), whose backward keeps d s_param's gradient in fp32
    return _attention(q, k, v, "ssmax", 1.0, None, scale, causal, attn_mask, dropout_p, softcap, q_scale)


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
    return _attention(q, k, v, "softmax1", 1.0, sink.reshape(-1), scale, causal, attn_mask, dropout_p, softcap)


def weights_attention(q, k, v, weights, params=(), *, scale=None, causal=True, attn_mask=None, enable_gqa=False,
                      dropout_p=0.0, softcap=None):
    """Attention whose weights a row-wise function defines: w = weights(s, visible, n) on blocks of query rows
    (scores with -inf on hidden keys, the visible keys, n visible keys per row); hidden keys get weight 0.

    The path of a norm that defines only its weights (retrofit.norms.weights_only): exact, memory O(T) forward and
    backward (each block recomputed, autograd through the formula on it), any device (rowwise.py). `params`: the
    tensors `weights` reads that need gradients (a norm's parameters). Dtypes as the other kernels: fp16/bf16
    computed in fp32, out in autocast's dtype under autocast, else in v's.
    """
    _check(q, k, v, attn_mask, enable_gqa, "weights_attention")
    if not callable(weights):
        raise ValueError(f"weights_attention: weights must be a function of (scores, visible, n); got {weights!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    softcap = check_softcap(softcap, "weights_attention")
    wide = _compute_dtype(q, k, v)
    out_dtype = wide if autocast_on(q.device.type) else v.dtype
    with dispatch.no_autocast(q.device.type):
        out = rowwise.forward(q.to(wide), k.to(wide), v.to(wide), weights, scale, bool(causal), attn_mask,
                              dropout_p, softcap, tuple(params))
    return out.to(out_dtype)


__all__ = ["psoftmax_attention", "ssmax_attention", "softmax1_attention", "weights_attention", "visible_counts",
           "causal_mask", "triton_backend", "force_backend"]
