"""The decode fast path: a call with a few query rows (KV-cache decoding) computed directly, any device.

    s   = scale * q k^T (+ mask bias; soft-capped first)      (B, Hkv, G*Tq, Tk) fp32, G query heads per kv head
    N_i = m_i + log(sum_j exp(p (s_ij - m_i))) / p             the p-normalizer (p = 1: the log-sum-exp)
    out = exp(s - m) v / exp(N - m)

At Tq <= MAX_ROWS the scores are a few rows per head (O(Tk) memory, as blockwise), but the blockwise
machinery (its plan, block loop, worker threads and per-block mask bias) costs more than the work: a
decode step of p-softmax took ~2x SDPA's time through it. Here it is two matmuls and a handful
of elementwise ops, with no copies of k or v for fp32 inputs. The query heads that share a kv head are
stacked as rows (q viewed (B, Hkv, G*Tq, D)), so GQA needs no repeat of k or v.

The backward recomputes s from q and k, as the other backends do, with the same formulas (blockwise.py):
dS = A * dA - A^p * delta, dq = scale dS k, dk = scale dS^T q, dv = A^T dO. fp16/bf16 inputs are computed
in fp32 (upcast here; on CUDA the matmuls could keep them, but decode attention is a small part of a step).
A row with no visible key gets out = 0, N = 0 and zero gradients, as in every backend.
"""

from __future__ import annotations

import torch

from .blockwise import compute_dtype
from .masks import Rows, as_4d, block_bias
from .softcap import chain_

MAX_ROWS = 16  # query rows per call: decode steps, speculative drafts, short chunks
MAX_SCORES = 1 << 24  # scores per call (64 MB fp32): longer contexts go to the blockwise / Triton kernels


def suits(q: torch.Tensor, k: torch.Tensor) -> bool:
    B, H, Tq = q.shape[:3]
    Tk = k.shape[2]
    return 0 < Tq <= MAX_ROWS and Tk > 0 and B * H * Tq * Tk <= MAX_SCORES


def _scores(q, k, scale: float, causal: bool, mask, softcap):
    """(s, tanh, may_be_empty): s (B*Hkv, G*Tq, Tk) in the compute dtype with hidden keys -inf, the tanh of
    the soft-cap (else None), and whether some row may see no key at all (only under a mask, or causal Tq > Tk)."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    ct = compute_dtype(q.dtype)
    if q.dtype != ct:
        q, k = q.to(ct), k.to(ct)
    qg = q.reshape(B * Hkv, G * Tq, D)  # a view for decode's (B, H, 1, D) queries
    s = torch.bmm(qg, k.reshape(B * Hkv, Tk, D).transpose(1, 2))  # (B*Hkv, G*Tq, Tk); bmm: 4-D matmul is slower
    tanh = None
    if softcap is None:
        s.mul_(scale)
    else:  # c tanh(scale q.k / c), before the mask (softcap.py); the backward needs the tanh
        tanh = s.mul_(scale / softcap).tanh_()
        s = tanh * softcap
    start, bias = block_bias(as_4d(mask), causal, Rows(0, Tq, Tq, Tk, Tk), q.device, ct)
    if bias is not None:  # (B', H' in {1, H}, Tq' in {1, Tq}, Tk - start)
        bias = bias.unsqueeze(1) if bias.shape[1] == 1 else bias.view(bias.shape[0], Hkv, G, *bias.shape[2:])
        s.view(B, Hkv, G, Tq, Tk)[..., start:] += bias
    return s, tanh, mask is not None or (causal and Tq > Tk)


def forward(q, k, v, p: float, scale: float, causal: bool, mask, softcap: float | None = None,
            out_dtype: torch.dtype | None = None):
    """out (B, H, Tq, Dv) in `out_dtype` (default q's) and N (B, H, Tq) in the compute dtype, as blockwise.forward."""
    B, H, Tq, _ = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    s, _, may_be_empty = _scores(q, k, scale, causal, mask, softcap)  # (B*Hkv, G*Tq, Tk)
    m = s.amax(-1, keepdim=True)
    if may_be_empty:
        m.masked_fill_(m == float("-inf"), 0.0)  # a row with no visible key: exp(-inf - 0) = 0, not NaN
    s.sub_(m)
    e = s.exp_() if p in (1.0, 2.0) else torch.exp(s)  # exp(s - m); p != 1, 2 keeps s - m for the p-th power
    if p == 1.0:
        den = e.sum(-1, keepdim=True)
    elif p == 2.0:  # ||e||_2 in one reduction
        den = torch.linalg.vector_norm(e, 2.0, dim=-1, keepdim=True)
    else:
        den = s.mul_(p).exp_().sum(-1, keepdim=True).pow_(1.0 / p)
    if may_be_empty:
        den.masked_fill_(den == 0, 1.0)  # only rows with no visible key have den = 0
    v3 = v.reshape(B * Hkv, Tk, Dv)
    out = torch.bmm(e, v3 if v3.dtype == e.dtype else v3.to(e.dtype)).div_(den)  # (B*Hkv, G*Tq, Dv)
    norm = m.add_(den.log_()).view(B, H, Tq)
    out = out.view(B, H, Tq, Dv)
    want = out_dtype or q.dtype
    return (out if out.dtype == want else out.to(want)), norm


def backward(dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask, softcap: float | None = None):
    """(dq, dk, dv) of sum(dout * out): dk and dv in their inputs' dtypes, dq in the compute dtype (as blockwise's)."""
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    s, tanh, _ = _scores(q, k, scale, causal, mask, softcap)  # (B*Hkv, G*Tq, Tk)
    ct = s.dtype
    rows = (H // Hkv) * Tq
    a = s.sub_(norm.to(ct).reshape(B * Hkv, rows, 1))  # s - N
    do = dout.to(ct).reshape(B * Hkv, rows, Dv)
    delta = (do * out.to(ct).reshape(B * Hkv, rows, Dv)).sum(-1, keepdim=True)  # dO . out, (B*Hkv, rows, 1)
    v3 = v.to(ct).reshape(B * Hkv, Tk, Dv)
    ds = torch.bmm(do, v3.transpose(1, 2))  # dA = dO v^T
    if p in (1.0, 2.0):
        a = a.exp_()  # A; hidden keys exp(-inf) = 0
        ds = ds.sub_(delta).mul_(a) if p == 1.0 else ds.addcmul_(a, delta, value=-1.0).mul_(a)
    else:
        ap = torch.exp(a * p)  # A^p = exp(p (s - N))
        a = a.exp_()
        ds = ds.mul_(a).sub_(ap.mul_(delta))
    if tanh is not None:
        chain_(ds, tanh)  # d/ds_raw = d/ds_capped * (1 - tanh^2)
    qg = q.to(ct).reshape(B * Hkv, rows, D)
    dq = torch.bmm(ds, k.to(ct).reshape(B * Hkv, Tk, D)).mul_(scale).view(B, H, Tq, D)
    dk = torch.bmm(ds.transpose(1, 2), qg).mul_(scale).view(k.shape)  # sums the G query heads of each kv head
    dv = torch.bmm(a.transpose(1, 2), do).view(v.shape)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
