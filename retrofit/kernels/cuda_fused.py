"""Every kernel norm on PyTorch's own fused CUDA attention kernels, through the log-sum-exp they return.

    out, L = aten._scaled_dot_product_flash_attention(q, k, v, ...)       # also: efficient, cudnn
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(dO, q, k, v, out, L, ...)

Each backward recomputes P = exp(s - L) from the (out, L) it is handed and delta = rowsum(dO * out),
and returns dS = P * (dO v^T - delta) pushed through to dq, dk, dv. Handing it *our* out and normalizer
N gives the norms (the identities of DESIGN.md, the same contract as cpu_fused.py):

  softmax, SSMax (q pre-scaled), softmax+1 (N = logaddexp(L, b), custom_ops.py): one forward, one backward.
  p-softmax, p != 1: N = LSE(p s) / p is a second forward with scale p * scale; out = out_1 exp(L - N).
      Its gradient dS = A * (dO v^T) - A_p * delta (A = exp(s - N), A_p = exp(p s - LSE(p s))) is two
      backward calls: (dO, out = 0, N) gives A * (dO v^T) and dv; (dO, v = 0, out, LSE(p s), scale p * scale)
      gives -A_p * delta with respect to p * s, so its dq and dk count 1/p.

Which kernel takes what (Tq == Tk or not, masks, dtypes) is `Fused.supports`; dispatch.py picks among them
per call (or a test forces one). GQA: flash takes fewer kv heads natively; efficient and cuDNN get k and v
repeated per query head, and their dk, dv are summed back per kv head. Masks (efficient only) become one
additive bias in q's dtype, its last dimension padded to a multiple of 16 as the kernel wants; a causal
chunk (Tq < Tk, bottom-right) folds the causal triangle into it. A row with no visible key gets out = 0 and
N = 0, so its weights and gradients are 0, as in every backend.

On an H100 (docs/results/gpu-h100/) flash and cuDNN pass `retrofit bench gpu`'s parity suite in bf16 and fp16; the
memory-efficient kernel's backward crashed there with an illegal memory access at training sizes (B*H = 128-512,
T = 4K-16K, bf16): retrofit handed it an `out` in the (B, H, T, D) memory layout, which that kernel reads with the
(B, T, H, D) row stride whatever the tensor's strides say (`_bthd` below; docs/results/gpu-h200-round4/). On a
CPU, tests/kernels/test_cuda_fused.py runs this composition over the fused CPU kernel standing in for the CUDA one;
on CUDA it runs each real kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .masks import Rows, as_4d, block_bias

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _aux(kind: str, device: str, dtype: torch.dtype) -> tuple:
    """The kernel's bookkeeping outputs (varlen offsets, dropout RNG state) for a plain call without dropout, as
    its forward returns them: its backward takes them back, and without dropout or varlen they carry no data."""
    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    if kind == "flash":
        _, _, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False)
        return cum_q, cum_k, seed, offset
    if kind == "efficient":
        _, _, seed, offset = aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, False)
        return None, None, seed, offset
    _, _, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0,
                                                                                          False, False)
    return cum_q, cum_k, seed, offset


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _bthd(x):
    """x (B, H, T, D) laid out in memory as (B, T, H, D), the layout the memory-efficient kernel's forward returns.
    Its backward reads `out` with a row stride it assumes to be H * D (the CUTLASS kernel's o_strideM() ignores the
    tensor's strides), so an `out` contiguous as (B, H, T, D) is read at the wrong rows: wrong gradients when small,
    an illegal memory access at training sizes (docs/results/gpu-h200-round4/efficient_repro.py)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


class Fused:
    """One of PyTorch's fused CUDA kernels ("flash", "efficient", "cudnn") as a retrofit backend."""

    def __init__(self, kind: str):
        self.kind = kind

    # ---------------------------------------------------------------- what it takes

    def supports(self, q, k, v, mask, causal: bool) -> bool:
        Tq, Tk, D = q.shape[2], k.shape[2], q.shape[-1]
        if not q.is_cuda or D != v.shape[-1] or Tq == 0 or Tk == 0:
            return False
        if self.kind == "efficient":
            return q.dtype in (*_HALF, torch.float32) and D % 8 == 0 and D <= 256
        square = not causal or Tq == Tk or Tq == 1  # is_causal is top-left: equal to ours only when Tq == Tk
        limit = 256 if self.kind == "flash" else 128
        return q.dtype in _HALF and mask is None and square and D % 8 == 0 and D <= limit

    @staticmethod
    def _flag(causal: bool, Tq: int, Tk: int) -> bool:
        """is_causal for the kernel: ours when it agrees with top-left alignment; else causal goes in the bias."""
        return causal and Tq == Tk and Tq > 1

    # ---------------------------------------------------------------- one kernel call

    def _inputs(self, q, k, v, causal: bool, mask, factor: float = 1.0):
        """(k, v) as the kernel takes them, the additive bias times `factor` (or None) and the rows with no
        visible key. The second call of p-softmax computes LSE(p s), s including the mask: its bias is p times."""
        H, Hkv = q.shape[1], k.shape[1]
        if H != Hkv and self.kind != "flash":
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        Tq, Tk = q.shape[2], k.shape[2]
        fold = causal and not self._flag(causal, Tq, Tk)
        if mask is None and not fold:
            return k, v, None, None
        start, bias = block_bias(as_4d(mask), fold and Tq > 1, Rows(0, Tq, Tq, Tk, Tk), q.device, torch.float32)
        if bias is None:
            return k, v, None, None
        bias = F.pad(bias, (start, 0)) if start > 0 else bias
        empty = torch.isneginf(bias).all(-1)  # (B', H', Tq') rows that see nothing
        store = torch.empty(*bias.shape[:2], Tq, _ceil(Tk, 16), dtype=q.dtype, device=q.device)
        store[..., :Tk] = bias * factor if factor != 1.0 else bias  # broadcasts a row-shared mask over the rows
        bias = store[..., :Tk].expand(q.shape[0], q.shape[1], Tq, Tk)
        return k, v, bias, (empty if bool(empty.any()) else None)

    def _forward(self, q, k, v, bias, scale: float, causal: bool):
        """(out, L) of softmax attention: L (B, H, Tq) fp32."""
        B, H, Tq, _ = q.shape
        if self.kind == "flash":
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        elif self.kind == "efficient":
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False,
                                                                scale=scale)[:2]
        return out, lse.reshape(B, H, -1)[..., :Tq].float()

    def _backward(self, dout, q, k, v, out, lse, bias, scale: float, causal: bool):
        """(dq, dk, dv) from the kernel's backward handed (out, lse) of our choosing."""
        Tq, Tk = q.shape[2], k.shape[2]
        cum_q, cum_k, seed, offset = _aux(self.kind, str(q.device), q.dtype)
        lse = lse.float().contiguous()
        if self.kind == "flash":
            return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, Tq, Tk,
                                                                     0.0, causal, seed, offset, scale=scale)
        if self.kind == "efficient":  # its log-sum-exp is kept padded to a multiple of 32 rows
            padded = F.pad(lse, (0, _ceil(Tq, 32) - Tq))
            grads = aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, bias, _bthd(out), padded, seed, offset, 0.0, [True, True, True, False], causal,
                scale=scale)
            return grads[:3]
        return aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse.unsqueeze(-1), seed, offset,
                                                                 bias, cum_q, cum_k, Tq, Tk, 0.0, causal, scale=scale)

    # ---------------------------------------------------------------- the backend interface (dispatch.py)

    def forward(self, q, k, v, p: float, scale: float, causal: bool, mask):
        """out (B, H, Tq, D) in q's dtype and N (B, H, Tq) fp32: out = exp(s - N) v."""
        k2, v2, bias, empty = self._inputs(q, k, v, causal, mask)
        flag = self._flag(causal, q.shape[2], k.shape[2])
        out, lse = self._forward(q, k2, v2, bias, scale, flag)
        norm = lse
        if p != 1.0:
            bias_p = self._inputs(q, k, v, causal, mask, p)[2]
            norm = self._forward(q, k2, v2, bias_p, p * scale, flag)[1] / p
            out = (out.float() * torch.exp(lse - norm).unsqueeze(-1)).to(q.dtype)
        if empty is not None:
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
            norm = norm.masked_fill(empty, 0.0)
        return out, norm

    def backward(self, dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask):
        """(dq, dk, dv): PyTorch's kernels write dq in q's dtype; p-softmax's sum of its two dq terms stays fp32 (the
        op rounds it once)."""
        Hkv = k.shape[1]
        k2, v2, bias, _ = self._inputs(q, k, v, causal, mask)
        flag = self._flag(causal, q.shape[2], k.shape[2])
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        if p == 1.0:
            dq, dk, dv = self._backward(dout, q, k2, v2, out, norm, bias, scale, flag)
        else:
            dq, dk, dv = self._backward(dout, q, k2, v2, torch.zeros_like(out), norm, bias, scale, flag)
            lse_p, bias_p = norm * p, self._inputs(q, k, v, causal, mask, p)[2]  # LSE(p s), p * bias
            dq_p, dk_p, _ = self._backward(dout, q, k2, torch.zeros_like(v2), out, lse_p, bias_p, p * scale, flag)
            dq = dq.float() + dq_p.float() / p
            dk = (dk.float() + dk_p.float() / p).to(k.dtype)
        if dk.shape[1] != Hkv:  # repeated kv heads: each kv head's gradient is the sum over its query heads
            dk = dk.view(dk.shape[0], Hkv, -1, *dk.shape[2:]).sum(2)
            dv = dv.view(dv.shape[0], Hkv, -1, *dv.shape[2:]).sum(2)
        return dq, dk.to(k.dtype), dv.to(v.dtype)


FLASH, EFFICIENT, CUDNN = Fused("flash"), Fused("efficient"), Fused("cudnn")
KERNELS = {"cuda_flash": FLASH, "cuda_efficient": EFFICIENT, "cuda_cudnn": CUDNN}
