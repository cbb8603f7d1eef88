"""Attention with weights any row-wise function defines: the kernel behind norms that define only their weights.

    out_i = sum_j w_ij v_j,   w_i = weights(s_i, visible_i, n_i)   with s_i = scale * q_i k^T (+ mask bias)

`weights` gets a block of query rows at a time: the scores s (B, H, R, K) in the compute dtype with -inf on every
key the row may not see (the mask's hidden keys, the causal future, soft-capped first as softcap.py says), the
visible keys as a bool tensor of the same shape, and n (B, H, R, 1), how many keys each row sees (at least 1).
Whatever it returns on a hidden key is replaced by 0, so the formula need not care about masks. The masks are
read by masks.block_bias, as every other backend reads them; nothing here is specific to one norm.

Memory: the rows of a block are chosen so it holds at most BLOCK_ELEMS scores, and nothing T x T exists at once.
With gradients, each block runs under activation checkpointing (non-reentrant): the backward recomputes that
block's scores, as the flash-style kernels do, so training memory is O(T) beyond the inputs. The blocks run from the
last rows to the first: a causal block's width grows with its rows, and blocks of growing size each took fresh heap
from glibc's allocator, which it kept (measured, T = 8192, H = 8, D = 64, CPU: a forward's resident peak 1098 MB
first rows first, 82 MB widest first; with the backward 1428 MB and 210 MB; live tensors alike, ~50 and ~130 MB). Autograd derives the
backward from the formula: a norm that defines its weights gets gradients for its parameters too.
Dropout drops weights after the formula, as SDPA does (checkpointing replays the same mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .masks import Rows, as_4d, block_bias, key_end

BLOCK_ELEMS = 1 << 21  # scores per block (8 MB fp32), as blockwise.py's budget


def rows_per_block(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """Query rows per block: at most BLOCK_ELEMS scores, at least one row."""
    return max(1, min(max(q_len, 1), BLOCK_ELEMS // max(1, batch * heads * kv_len)))


def forward(q, k, v, weights, scale: float, causal: bool, mask, dropout_p: float = 0.0,
            softcap: float | None = None) -> torch.Tensor:
    """out (B, H, Tq, Dv) in the compute dtype: fp32 for fp16/bf16 inputs, fp64 for fp64."""
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(ct).reshape(B, Hkv, H // Hkv, Tq, D)  # the G query heads of each kv head side by side
    kc, vc = k.to(ct).reshape(B * Hkv, Tk, D), v.to(ct).reshape(B * Hkv, Tk, Dv)  # views for contiguous inputs
    mask4 = as_4d(mask)
    rows = rows_per_block(B, H, Tq, Tk)
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    blocks = []
    for r0 in reversed(range(0, Tq, rows)):  # the widest block first: see the module docstring (Memory)
        r1 = min(r0 + rows, Tq)
        end = key_end(causal, r1, Tq, Tk)
        if end == 0:  # these rows see no key: output 0
            blocks.append(torch.zeros(B, H, r1 - r0, Dv, dtype=ct, device=q.device))
            continue
        part = Rows(r0, r1, Tq, Tk, end)

        def block(qb, kb, vb, part=part):
            return _block(qb, kb, vb, weights, part, (B, H), scale, causal, mask4, dropout_p, softcap)

        args = (qg[:, :, :, r0:r1].reshape(B * Hkv, -1, D), kc[:, :end], vc[:, :end])
        if record and not torch.compiler.is_compiling():
            blocks.append(checkpoint(block, *args, use_reentrant=False))
        else:
            blocks.append(block(*args))
    return torch.cat(blocks[::-1], dim=2) if len(blocks) != 1 else blocks[0]


def _block(qb, kb, vb, weights, part: Rows, heads: tuple, scale: float, causal: bool, mask4, dropout_p: float,
           softcap):
    """One block of rows: qb (B*Hkv, G*R, D), kb/vb (B*Hkv, end, D) -> (B, H, R, Dv). bmm's, as decode.py: the G
    query heads of a kv head are rows of one matrix product, so no copy of k or v is made for them."""
    (B, H), R = heads, part.r1 - part.r0
    s = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale).view(B, H, R, part.end)  # (B, H, R, end)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap  # before the mask (softcap.py)
    start, bias = block_bias(mask4, causal, part, s.device, s.dtype)
    if bias is None:  # every key of the block is visible (a decode step, a block left of the diagonal)
        visible = torch.ones((), dtype=torch.bool, device=s.device).expand(s.shape)
        w = weights(s, visible, torch.full((1, 1, 1, 1), float(part.end), dtype=s.dtype, device=s.device))
    else:
        s = s + bias if start == 0 else torch.cat([s[..., :start], s[..., start:] + bias], dim=-1)
        visible = ~torch.isneginf(s)
        n = visible.sum(-1, keepdim=True, dtype=s.dtype).clamp_min(1.0)  # (B, H, R, 1)
        w = torch.where(visible, weights(s, visible, n), 0.0)  # a hidden key's weight is 0, whatever the formula says
    if dropout_p > 0:
        w = F.dropout(w, dropout_p, training=True)
    return torch.bmm(w.reshape(qb.shape[0], -1, part.end), vb).view(B, H, R, vb.shape[-1])
