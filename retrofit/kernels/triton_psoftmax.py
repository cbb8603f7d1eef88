"""Fused flash-style p-softmax attention for CUDA in Triton: forward and backward, O(T) memory.

Used automatically by retrofit.kernels when q is on CUDA and Triton imports; importing this module
never fails without Triton (AVAILABLE is then False). CI runs it on CPU through Triton's interpreter
(tests/kernels/test_triton_interpreter.py: fp32 and fp16 against a float64 reference, forward and backward);
tests/kernels/test_kernels.py compares it with the blockwise PyTorch kernel on CUDA, bf16 included.

Forward, per block of BLOCK_M query rows, streaming BLOCK_N keys at a time (online row max m):

    m'  = max(m, max_j s_ij);   alpha = exp(m - m')
    den = den * alpha^p + sum_j exp(p (s_ij - m'))           (the p-th power of ||exp(s - m')||_p)
    num = num * alpha   + sum_j exp(s_ij - m') v_j
    out = num / den^(1/p),   N = m + log(den) / p            (N is saved for the backward)

Backward recomputes A = exp(s - N) block by block; with delta_i = dO_i . out_i (computed in torch):

    dS = A * (dO v^T) - A^p * delta;   dq = scale dS k,  dk = scale dS^T q,  dv = A^T dO

one kernel over key blocks (dk, dv; it loops over the G query heads sharing a kv head, so GQA needs
no atomics) and one over query blocks (dq). Logits accumulate in fp32 (IEEE, not TF32, for fp32
inputs); for fp16/bf16 the weights are rounded to the input dtype before the P V product, as flash
attention does. Causal is bottom-right; masks are read through their strides (broadcast = stride 0).
A row with no visible key gets out = 0 and N = 0, so its weights and gradients are 0.

Not implemented here: logit soft-capping (`softcap`) and attention dropout. retrofit.kernels routes
calls with either to the blockwise backend, so this kernel never sees them. q, k, v of mixed dtypes
(bf16 autocast) are upcast to one dtype before any backend is chosen, so they arrive here equal.
"""

from __future__ import annotations

import os

import torch

from .masks import as_4d

try:
    import triton
    import triton.language as tl
    AVAILABLE = True
except Exception:  # ImportError, or a Triton that cannot find its compiler
    AVAILABLE = False

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton's interpreter (TRITON_INTERPRET=1, read by Triton at import) runs the kernels on CPU tensors: CI's
# parity tests (tests/kernels/test_triton_interpreter.py). retrofit.kernels still never picks it for CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def supports(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    on_device = q.is_cuda or (INTERPRETED and q.device.type == "cpu")
    return (AVAILABLE and on_device and q.dtype in _DTYPES and q.shape[-1] == v.shape[-1] <= 256
            and (mask is None or mask.dtype == torch.bool or mask.dtype in _DTYPES))


if AVAILABLE:

    @triton.jit
    def _scores(q, k, rows, cols, b, h, Mask, smb, smh, smm, smn, Tq, Tk, scale, mask_floor,
                CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr):
        """(BLOCK_M, BLOCK_N) fp32 logits scale * q k^T (+ additive mask), -inf where hidden."""
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = (rows[:, None] < Tq) & (cols[None, :] < Tk)
        if CAUSAL:  # bottom-right: query row r sits at position Tk - Tq + r
            valid = valid & (cols[None, :] <= (Tk - Tq) + rows[:, None])
        if MASK_KIND == 1:  # bool, True = attend
            mv = tl.load(Mask + b * smb + h * smh + rows[:, None] * smm + cols[None, :] * smn,
                         mask=(rows[:, None] < Tq) & (cols[None, :] < Tk), other=0)
            valid = valid & (mv != 0)
        if MASK_KIND == 2:  # additive; the dtype's minimum (transformers' "hidden") counts as hidden
            mv = tl.load(Mask + b * smb + h * smh + rows[:, None] * smm + cols[None, :] * smn,
                         mask=(rows[:, None] < Tq) & (cols[None, :] < Tk), other=0.0).to(tl.float32)
            s = s + mv
            valid = valid & (mv > mask_floor)
        return tl.where(valid, s, float("-inf"))

    @triton.jit
    def _key_end(pid_m, Tq, Tk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """Keys [0, end) that any row of query block pid_m may see."""
        if CAUSAL:
            return tl.maximum(tl.minimum(Tk, Tk - Tq + (pid_m + 1) * BLOCK_M), 0)
        return Tk

    @triton.jit
    def _fwd_kernel(Q, K, V, Out, Norm, Mask,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                    sob, soh, som, sod, snb, snh, snm, smb, smh, smm, smn,
                    H, G, Tq, Tk, D, scale, p, mask_floor,
                    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_KIND: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        hk = h // G  # GQA: query head h reads kv head h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                    mask=(rows[:, None] < Tq) & (dims[None, :] < D), other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        num = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, _key_end(pid_m, Tq, Tk, BLOCK_M, CAUSAL), BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kv_mask = (cols[:, None] < Tk) & (dims[None, :] < D)
            k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
            s = _scores(q, k, rows, cols, b, h, Mask, smb, smh, smm, smn, Tq, Tk, scale, mask_floor,
                        CAUSAL, MASK_KIND, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            e = tl.exp(s - m_safe[:, None])  # hidden: exp(-inf) = 0
            if P_KIND == 1:
                ep = e
                alpha_p = tl.exp(m_i - m_safe)
            elif P_KIND == 2:
                ep = e * e
                alpha_p = tl.exp(2.0 * (m_i - m_safe))
            else:
                ep = tl.exp(p * (s - m_safe[:, None]))
                alpha_p = tl.exp(p * (m_i - m_safe))
            den = den * alpha_p + tl.sum(ep, 1)
            num = num * tl.exp(m_i - m_safe)[:, None] + tl.dot(e.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        empty = den == 0.0
        den_safe = tl.where(empty, 1.0, den)
        if P_KIND == 1:
            root = den_safe
        elif P_KIND == 2:
            root = tl.sqrt(den_safe)
        else:
            root = tl.exp(tl.log(den_safe) / p)
        out = num / root[:, None]
        norm = tl.where(empty, 0.0, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(den_safe) / p)
        tl.store(Out + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, out.to(Out.dtype.element_ty),
                 mask=(rows[:, None] < Tq) & (dims[None, :] < D))
        tl.store(Norm + b * snb + h * snh + rows * snm, norm, mask=rows < Tq)

    @triton.jit
    def _weights_grad(s, norm, delta, dp, p, P_KIND: tl.constexpr):
        """(A, dS) for A = exp(s - N): dS = A * dp - A^p * delta; hidden (s = -inf) gives 0 for both."""
        x = s - norm[:, None]
        a = tl.exp(x)
        if P_KIND == 1:
            ds = a * (dp - delta[:, None])
        elif P_KIND == 2:
            ds = a * (dp - a * delta[:, None])
        else:
            ds = a * dp - tl.exp(p * x) * delta[:, None]
        return a, ds

    @triton.jit
    def _bwd_kv_kernel(Q, K, V, DO, Norm, Delta, DK, DV, Mask,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                       snb, snh, snm, smb, smh, smm, smn,
                       Hkv, G, Tq, Tk, D, scale, p, mask_floor,
                       CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_KIND: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dk, dv for one block of keys; q/dO/N/delta/dk/dv share strides with q/k/N (made contiguous alike)."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b, hk = bh // Hkv, bh % Hkv
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        kv_mask = (cols[:, None] < Tk) & (dims[None, :] < D)
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        first_row = 0
        if CAUSAL:  # rows before Tk - Tq + row >= first column cannot see this block
            first_row = tl.maximum(pid_n * BLOCK_N - (Tk - Tq), 0) // BLOCK_M * BLOCK_M
        for g in range(G):
            h = hk * G + g
            for start in range(first_row, Tq, BLOCK_M):
                rows = start + tl.arange(0, BLOCK_M)
                q_mask = (rows[:, None] < Tq) & (dims[None, :] < D)
                q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask, other=0.0)
                do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask,
                             other=0.0)
                norm = tl.load(Norm + b * snb + h * snh + rows * snm, mask=rows < Tq, other=0.0)
                delta = tl.load(Delta + b * snb + h * snh + rows * snm, mask=rows < Tq, other=0.0)
                s = _scores(q, k, rows, cols, b, h, Mask, smb, smh, smm, smn, Tq, Tk, scale, mask_floor,
                            CAUSAL, MASK_KIND, PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                a, ds = _weights_grad(s, norm, delta, dp, p, P_KIND)
                dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PRECISION)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        tl.store(DK + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd,
                 (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd,
                 dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_q_kernel(Q, K, V, DO, Norm, Delta, DQ, Mask,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                      snb, snh, snm, smb, smh, smm, smn,
                      H, G, Tq, Tk, D, scale, p, mask_floor,
                      CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_KIND: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dq for one block of query rows."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        hk = h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        q_mask = (rows[:, None] < Tq) & (dims[None, :] < D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask, other=0.0)
        do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd, mask=q_mask, other=0.0)
        norm = tl.load(Norm + b * snb + h * snh + rows * snm, mask=rows < Tq, other=0.0)
        delta = tl.load(Delta + b * snb + h * snh + rows * snm, mask=rows < Tq, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, _key_end(pid_m, Tq, Tk, BLOCK_M, CAUSAL), BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kv_mask = (cols[:, None] < Tk) & (dims[None, :] < D)
            k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
            s = _scores(q, k, rows, cols, b, h, Mask, smb, smh, smm, smn, Tq, Tk, scale, mask_floor,
                        CAUSAL, MASK_KIND, PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            _, ds = _weights_grad(s, norm, delta, dp, p, P_KIND)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _config(q):
    """Block sizes and constexprs shared by the three kernels."""
    D = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(D))
    wide = block_d > 64 or q.dtype == torch.float32  # keep the tiles within shared memory on smaller GPUs
    return dict(BLOCK_M=32 if wide else 64, BLOCK_N=32 if wide else 64, BLOCK_D=block_d,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)


def _mask_args(mask, B, H, Tq, Tk, device):
    """(tensor, 4 strides, kind, floor): kind 0 none, 1 bool, 2 additive; broadcast dims get stride 0."""
    if mask is None:
        return torch.empty(1, device=device), (0, 0, 0, 0), 0, 0.0
    m = as_4d(mask).expand(B, H, Tq, Tk)  # a view: no copy
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), 1, 0.0
    return m, m.stride(), 2, torch.finfo(m.dtype).min / 2


def _p_kind(p):
    return 1 if p == 1.0 else 2 if p == 2.0 else 0


def forward(q, k, v, p: float, scale: float, causal: bool, mask, out_dtype=None):
    """out (B, H, Tq, D) in `out_dtype` (default q's; the kernel accumulates in fp32) and N (B, H, Tq) fp32, as
    blockwise.forward."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    norm = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
    mask_t, ms, kind, floor = _mask_args(mask, B, H, Tq, Tk, q.device)
    cfg = _config(q)
    grid = (triton.cdiv(Tq, cfg["BLOCK_M"]), B * H)
    _fwd_kernel[grid](q, k, v, out, norm, mask_t, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                      *norm.stride(), *ms, H, H // Hkv, Tq, Tk, D, scale, float(p), floor,
                      CAUSAL=causal, MASK_KIND=kind, P_KIND=_p_kind(p), **cfg)
    return out, norm


def backward(dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask, dq_dtype=None):
    """(dq, dk, dv) as blockwise.backward: dq accumulates in fp32 and is stored in `dq_dtype` (else q's)."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dout = dout.to(q.dtype).contiguous()
    norm = norm.float().contiguous()
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, H, Tq), same strides as norm
    dq, dk, dv = torch.empty_like(q, dtype=dq_dtype or q.dtype), torch.empty_like(k), torch.empty_like(v)
    mask_t, ms, kind, floor = _mask_args(mask, B, H, Tq, Tk, q.device)
    cfg = _config(q)
    common = dict(CAUSAL=causal, MASK_KIND=kind, P_KIND=_p_kind(p), **cfg)
    strides = (*q.stride(), *k.stride(), *v.stride(), *norm.stride(), *ms)
    _bwd_kv_kernel[(triton.cdiv(Tk, cfg["BLOCK_N"]), B * Hkv)](
        q, k, v, dout, norm, delta, dk, dv, mask_t, *strides, Hkv, H // Hkv, Tq, Tk, D, scale, float(p), floor,
        **common)
    _bwd_q_kernel[(triton.cdiv(Tq, cfg["BLOCK_M"]), B * H)](
        q, k, v, dout, norm, delta, dq, mask_t, *strides, H, H // Hkv, Tq, Tk, D, scale, float(p), floor,
        **common)
    return dq, dk, dv
