"""Every kernel norm on FlexAttention (CUDA), through its differentiable log-sum-exp.

    out, L = flex_attention(q, k, v, block_mask=causal, scale=scale, return_lse=True)   # compiled, CUDA

Softmax and SSMax (q pre-scaled) are one call; softmax+1 is out * exp(L - logaddexp(L, b_h)); p-softmax is
two, out = out_1 exp(L - N) with N = LSE(p s) / p from a call on p * q. Unlike the other backends this one
is not wrapped in retrofit's custom op: FlexAttention is differentiable (its L too, on CUDA) and traceable by
itself, and autograd does not record inside a custom op's implementation (the first H100 run failed so).

Takes causal (bottom-right, as a block mask cached per shape) and unmasked calls; masks go elsewhere.
FlexAttention on CPU has no backward and no L in torch 2.13 (DESIGN.md), so this backend is CUDA-only.
Each new shape compiles once (seconds); the compiled function is shared by every call.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q, k, v, mask, causal: bool) -> bool:  # dropout and soft-capping never reach it (dispatch.py)
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


def attention(q, k, v, sink, p: float, scale: float, causal: bool):
    """out (B, H, Tq, D) in q's dtype, differentiable through FlexAttention's own backward (its L included):
    softmax+1 is out * exp(L - logaddexp(L, b_h)), p-softmax the two calls above."""
    if p != 1.0:
        return _psoftmax(q, k, v, p, scale, causal)[0]
    out, lse = _call(q, k, v, scale, causal)
    if sink is None:
        return out
    with_sink = torch.logaddexp(lse, sink.float().view(1, -1, 1))
    return (out.float() * torch.exp(lse - with_sink).unsqueeze(-1)).to(q.dtype)
