"""Every kernel norm on FlexAttention (CUDA), through its differentiable log-sum-exp.

    out, L = flex_attention(q, k, v, block_mask=causal, scale=scale, return_lse=True)   # compiled, CUDA

Forward: softmax, SSMax (q pre-scaled) and softmax+1 (ops.py turns L into logaddexp(L, b)) are one call;
p-softmax is two, out = out_1 exp(L - N) with N = LSE(p s) / p from a call with scale p * scale.
Backward recomputes through autograd: for p = 1 the gradient of sum(dO * out) with out = exp(s - N) v and
dN/ds = exp(s - N) (softmax, and softmax+1 whatever its sink) equals softmax's vector-Jacobian product at
the cotangent g = exp(L - N) dO (the derivation is DESIGN.md's identity for the fused kernels), so one
recomputed call suffices; for p != 1 the two calls are differentiated as written (FlexAttention's L has a
gradient on CUDA).

Takes causal (bottom-right, as a block mask cached per shape) and unmasked calls; masks go elsewhere.
FlexAttention on CPU has no backward and no L in torch 2.13 (DESIGN.md), so this backend is CUDA-only.
Each new shape compiles once (seconds); the compiled function is shared by every call.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q, k, v, mask, causal: bool) -> bool:
    D = q.shape[-1]
    return (q.is_cuda and mask is None and q.dtype in _DTYPES and D == v.shape[-1] and D >= 16
            and D & (D - 1) == 0 and q.shape[2] > 0 and k.shape[2] > 0)


@functools.lru_cache(maxsize=1)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled function for every call; parity suites and models with several shapes recompile it per shape
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def _causal(Tq: int, Tk: int, device: str):
    """The bottom-right causal block mask for Tq queries on Tk keys (cached: a new mask function recompiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = Tk - Tq

    def bottom_right(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(bottom_right, None, None, Tq, Tk, device=device)


def _call(q, k, v, scale: float, causal: bool):
    """(out, L) of softmax attention, both differentiable."""
    Tq, Tk = q.shape[2], k.shape[2]
    block_mask = _causal(Tq, Tk, str(q.device)) if causal and Tq > 1 else None
    out, lse = _compiled()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
                           return_lse=True)
    return out, lse.float()


def _psoftmax(q, k, v, p: float, scale: float, causal: bool):
    out, lse = _call(q, k, v, scale, causal)
    norm = _call(q * p, k, v, scale, causal)[1] / p  # LSE(p s): q scaled, so the compiled kernel is the same one
    return (out.float() * torch.exp(lse - norm).unsqueeze(-1)).to(q.dtype), norm


def forward(q, k, v, p: float, scale: float, causal: bool, mask):
    """out (B, H, Tq, D) in q's dtype and N (B, H, Tq) fp32: out = exp(s - N) v. Run with grad enabled (and the
    graph dropped at once) so that forward and backward share one compiled kernel per shape, not two."""
    with torch.enable_grad():
        out, norm = _psoftmax(q, k, v, p, scale, causal) if p != 1.0 else _call(q, k, v, scale, causal)
    return out.detach(), norm.detach()


def backward(dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        if p != 1.0:
            again = _psoftmax(*leaves, p, scale, causal)[0]
            cotangent = dout.to(again.dtype)
        else:
            again, lse = _call(*leaves, scale, causal)
            cotangent = (dout.float() * torch.exp(lse.detach() - norm).unsqueeze(-1)).to(again.dtype)
        return torch.autograd.grad(again, leaves, cotangent)
