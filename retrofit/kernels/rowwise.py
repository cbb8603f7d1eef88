"""Attention with weights any row-wise function defines: the kernel behind norms that define only their weights.

    out_i = sum_j w_ij v_j,   w_i = weights(s_i, visible_i, n_i)   with s_i = scale * q_i k^T (+ mask bias)

`weights` gets a block of query rows at a time: the scores s (B, H, R, K) in the compute dtype with -inf on every
key the row may not see (the mask's hidden keys, the causal future, soft-capped first as softcap.py says), the
visible keys as a bool tensor of the same shape, and n (B, H, R, 1), how many keys each row sees (at least 1).
Whatever it returns on a hidden key is replaced by 0, so the formula need not care about masks. The masks are
read by masks.block_bias, as every other backend reads them; nothing here is specific to one norm.

Forward: blocks of query rows, each at most BLOCK_ELEMS scores, nothing T x T. The G query heads of a kv head are
rows of one bmm (as decode.py), so GQA copies no k or v. Backward (RowwiseAttention): each block's scores are
recomputed from q and k, as the flash-style kernels do; autograd differentiates the formula on that block alone
(dS = dW . dW/dS, with dW = dO V^T), and dq, dk, dv are accumulated in place into tensors of the inputs' sizes,
so training memory is O(T) beyond the inputs, and the formula's own parameters (`params`) get their gradients.
Dropout drops weights after the formula, as SDPA does; each block's mask comes from a generator seeded by the
call's seed and the block's first row, so the backward regenerates it.

The blocks run from the last rows to the first: a causal block's width grows with its rows, and blocks of growing
size each took fresh heap from glibc's allocator, which it kept (measured, T = 8192, H = 8, D = 64, CPU: a
forward's resident peak 1098 MB first rows first, 82 MB widest first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import Rows, as_4d, block_bias, key_end

BLOCK_ELEMS = 1 << 21  # scores per block (8 MB fp32), as blockwise.py's budget


@dataclass(frozen=True)
class Call:
    """What one call computes beside q, k, v: the formula and how the scores are made."""

    weights: object  # (scores, visible, n) -> weights
    scale: float
    causal: bool
    mask: torch.Tensor | None  # 4-D (masks.as_4d) or None
    dropout_p: float = 0.0
    softcap: float | None = None
    seed: int = 0  # dropout's, drawn once per call


def rows_per_block(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """Query rows per block: at most BLOCK_ELEMS scores, at least one row."""
    return max(1, min(max(q_len, 1), BLOCK_ELEMS // max(1, batch * heads * kv_len)))


def forward(q, k, v, weights, scale: float, causal: bool, mask, dropout_p: float = 0.0,
            softcap: float | None = None, params: tuple = ()) -> torch.Tensor:
    """out (B, H, Tq, Dv) in the compute dtype (fp32 for fp16/bf16 inputs, fp64 for fp64). `params`: the tensors
    `weights` reads that need gradients (a norm's parameters)."""
    seed = int(torch.randint(2 ** 62, (), device="cpu")) if dropout_p > 0 else 0
    call = Call(weights, scale, causal, as_4d(mask), dropout_p, softcap, seed)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params)) \
            and not torch.compiler.is_compiling():
        return RowwiseAttention.apply(call, q, k, v, *params)
    # no graph, or torch.compile: Dynamo cannot trace the Function's backward (its torch.autograd.grad), so the blocks
    # are traced as the plain ops they are and AOTAutograd derives the backward (keeping every block's activations)
    return attend(call, q, k, v)


def blocks(B: int, H: int, q_len: int, kv_len: int, causal: bool):
    """Each block of rows that sees a key, as masks.Rows, the widest (last rows) first."""
    rows = rows_per_block(B, H, q_len, kv_len)
    for r0 in reversed(range(0, q_len, rows)):
        r1 = min(r0 + rows, q_len)
        end = key_end(causal, r1, q_len, kv_len)
        if end > 0:  # rows that see no key keep output 0 and zero gradients
            yield Rows(r0, r1, q_len, kv_len, end)


def layout(q, k, v):
    """(compute dtype, q (B, Hkv, G, Tq, D), k (B*Hkv, Tk, D), v (B*Hkv, Tk, Dv)): views for contiguous inputs."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (ct, q.to(ct).reshape(B, Hkv, H // Hkv, Tq, D), k.to(ct).reshape(B * Hkv, k.shape[2], D),
            v.to(ct).reshape(B * Hkv, v.shape[2], v.shape[-1]))


def raw_scores(qb, kb, shape: tuple, part: Rows, scale: float) -> torch.Tensor:
    """scale * q k^T of one block: qb (B*Hkv, G*R, D), kb (B*Hkv, end, D) -> (B, H, R, end)."""
    return torch.bmm(qb, kb.transpose(1, 2)).mul_(scale).view(*shape, part.r1 - part.r0, part.end)


def block_weights(s: torch.Tensor, call: Call, part: Rows) -> torch.Tensor:
    """The weights (B, H, R, end) of one block from its raw scores: soft-cap, mask, the formula, dropout."""
    if call.softcap is not None:
        s = torch.tanh(s / call.softcap) * call.softcap  # before the mask (softcap.py)
    start, bias = block_bias(call.mask, call.causal, part, s.device, s.dtype)
    if bias is None:  # every key of the block is visible (a decode step, rows without a mask)
        visible = torch.ones((), dtype=torch.bool, device=s.device).expand(s.shape)
        w = call.weights(s, visible, torch.full((1, 1, 1, 1), float(part.end), dtype=s.dtype, device=s.device))
    else:
        s = s + bias if start == 0 else torch.cat([s[..., :start], s[..., start:] + bias], dim=-1)
        visible = ~torch.isneginf(s)
        n = visible.sum(-1, keepdim=True, dtype=s.dtype).clamp_min(1.0)  # (B, H, R, 1)
        w = torch.where(visible, call.weights(s, visible, n), 0.0)  # a hidden key's weight is 0, whatever it says
    if call.dropout_p > 0:
        w = w * keep_mask(call, part, w)
    return w


def keep_mask(call: Call, part: Rows, w: torch.Tensor) -> torch.Tensor:
    """Dropout's M / (1 - p) for one block, the same in the forward and the backward (seeded by the call and r0)."""
    gen = torch.Generator(device=w.device)
    gen.manual_seed(hash((call.seed, part.r0)) & (2 ** 63 - 1))  # int tuples hash alike in every run
    keep = torch.rand(w.shape, generator=gen, dtype=w.dtype, device=w.device) >= call.dropout_p
    return keep.to(w.dtype) / (1.0 - call.dropout_p)


def attend(call: Call, q, k, v) -> torch.Tensor:
    """The forward: out (B, H, Tq, Dv) in the compute dtype (differentiable as plain ops, which torch.compile uses)."""
    B, H, Tq, D = q.shape
    ct, qg, kc, vc = layout(q, k, v)
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=ct, device=q.device)
    for part in blocks(B, H, Tq, k.shape[2], call.causal):
        qb = qg[:, :, :, part.r0:part.r1].reshape(kc.shape[0], -1, D)
        w = block_weights(raw_scores(qb, kc[:, :part.end], (B, H), part, call.scale), call, part)
        rows = torch.bmm(w.reshape(kc.shape[0], -1, part.end), vc[:, :part.end])  # (B*Hkv, G*R, Dv)
        out[:, :, part.r0:part.r1] = rows.view(B, H, part.r1 - part.r0, -1)
    return out


class RowwiseAttention(torch.autograd.Function):
    """attend() with the backward the module docstring describes: (call, q, k, v, *params) -> out."""

    @staticmethod
    def forward(ctx, call: Call, q, k, v, *params):
        ctx.call = call
        ctx.save_for_backward(q, k, v, *params)
        return attend(call, q, k, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *params = ctx.saved_tensors
        call, (B, H, Tq, D) = ctx.call, q.shape
        ct, qg, kc, vc = layout(q, k, v)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kc), torch.zeros_like(vc)
        learned = [p for p in params if p.requires_grad]
        dparams = [torch.zeros_like(p) for p in learned]
        do = dout.to(ct).reshape(qg.shape[:-1] + (dout.shape[-1],))  # (B, Hkv, G, Tq, Dv)
        for part in blocks(B, H, Tq, k.shape[2], call.causal):
            qb = qg[:, :, :, part.r0:part.r1].reshape(kc.shape[0], -1, D)
            dob = do[:, :, :, part.r0:part.r1].reshape(kc.shape[0], -1, do.shape[-1])
            kb, vb = kc[:, :part.end], vc[:, :part.end]
            with torch.enable_grad():
                s = raw_scores(qb, kb, (B, H), part, call.scale).requires_grad_()
                w = block_weights(s, call, part)
            dw = torch.bmm(dob, vb.transpose(1, 2)).view(w.shape)  # dO V^T
            grads = torch.autograd.grad(w, (s, *learned), dw, allow_unused=True)
            ds = grads[0].reshape(kc.shape[0], -1, part.end).mul_(call.scale)  # (B*Hkv, G*R, end)
            dq[:, :, :, part.r0:part.r1] = torch.bmm(ds, kb).view(B, kc.shape[0] // B, -1, part.r1 - part.r0, D)
            dk[:, :part.end].baddbmm_(ds.transpose(1, 2), qb)  # the G query heads of a kv head summed
            dv[:, :part.end].baddbmm_(w.detach().reshape(kc.shape[0], -1, part.end).transpose(1, 2), dob)
            for total, grad in zip(dparams, grads[1:]):
                if grad is not None:
                    total += grad
        given = iter(dparams)
        return (None, dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
                *(next(given).to(p.dtype) if p.requires_grad else None for p in params))
