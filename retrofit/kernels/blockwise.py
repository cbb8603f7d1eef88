"""Exact p-softmax attention in bounded blocks of plain PyTorch: any device, any p > 0, O(T) memory.

With logits s = scale * q k^T (plus mask bias; hidden keys are -inf) and m_i = max_j s_ij:

    N_i   = m_i + log(sum_j exp(p (s_ij - m_i))) / p        the row's p-normalizer (p = 1: the LSE)
    A_ij  = exp(s_ij - N_i) = exp(s_ij) / ||exp(s_i)||_p     the weights
    out_i = sum_j A_ij v_j

Forward works on one block at a time: a few heads x c query rows x the keys those rows may see
(bottom-right causal: keys [0, Tk - Tq + r1)), c chosen so a block holds at most BLOCK_ELEMS scores.
So nothing T x T ever exists; memory is O(T) (c rows x T keys), and the causal upper triangle is
skipped except inside the diagonal block. It returns `out` and N (B, H, Tq); the backward
recomputes each block's logits from q and k (as flash attention does):

    dA_ij = dO_i . v_j,   delta_i = dO_i . out_i,   dN_i/ds_ij = A_ij^p  (= softmax(p s)_ij)
    dS    = A * dA - A^p * delta = A * (dA - A^(p-1) * delta)
    dq = scale dS k,   dk = scale dS^T q,   dv = A^T dO

Attention dropout (training): each weight is kept with probability 1 - rate and scaled by
1 / (1 - rate) after normalization, as SDPA does: out_i = sum_j A_ij M_ij v_j. N is unchanged, so
the backward is the same with dA_ij = M_ij dO_i . v_j and dv = (A * M)^T dO (delta = dO . out still
equals sum_j A_ij dA_ij). M is never stored: every block regenerates it from a generator seeded by
(seed, batch row, kv head, first row), so forward and backward see the same mask.

Soft-capping (`softcap` c, see softcap.py): s_ij = c tanh(scale q_i.k_j / c) before the mask bias; the
backward multiplies dS by 1 - tanh^2 before it reaches dq and dk.

A row with no visible key has m = -inf; it is given m = 0, so its weights are exp(-inf) = 0, its
output 0 and N = 0, and its gradients 0 (never NaN). fp16/bf16 inputs are computed in fp32.

Threads: per block the forward runs ~8 ops and the backward ~11, each a few ms of work. Run with
torch's usual intra-op threads, every op is an OpenMP barrier; when another process holds a core,
each barrier waits for a scheduler slice. Measured on the busy 2-core dev box (load ~5), a T=4096
forward (H=8, D=64, p=2) took 0.8 s on one thread and 5.9 s on two, 19x SDPA (one big op, which
does not suffer). So on CPU the blocks are shared out to torch.get_num_threads() Python threads,
each running its ops on one thread (torch ops release the GIL): 1.5x SDPA on the same busy box.
Blocks that accumulate into the same dk/dv rows (one batch row and kv-head group) always go to the
same thread, so no two threads write the same memory and the result does not depend on timing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import NamedTuple

import torch

from .masks import Rows, as_4d, block_bias, key_end
from .softcap import cap_, capped_minus_norm, chain_

# Scores in all blocks in flight (heads x rows x keys, split among the threads); 2M fp32 = 8 MB, and two
# or three temporaries of a block's size live at once. Measured on the 2-core dev CPU at T=4096 (H=8,
# D=64, one thread): 128 rows x 2-4 heads was fastest of 32..256 rows x 1..8 heads (1.4x SDPA's forward);
# smaller blocks pay per-op overhead, larger ones fall out of cache. Past T = 16384 the rows shrink to
# keep the budget, down to MIN_ROWS: 16 rows made a T=65536 forward 2.0x SDPA, 32 rows 1.6x.
BLOCK_ELEMS = 1 << 21
MAX_ROWS, MIN_ROWS = 128, 32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Block(NamedTuple):
    """One block of the loop: batch row b, kv heads h0:h1 (their G query heads each), query rows r0:r1, keys :end."""

    b: int
    h0: int
    h1: int
    r0: int
    r1: int
    end: int


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Attention-weight dropout for one kernel call: `rate` in (0, 1), `seed` drawn once per call."""

    rate: float
    seed: int

    def keep(self, blk: Block, G: int, dtype, device) -> torch.Tensor:
        """M / (1 - rate) for the block's kv heads (their G query heads each), rows and keys: (hc, G*c, end)."""
        parts = []
        for h in range(blk.h0, blk.h1):
            gen = torch.Generator(device=device)
            gen.manual_seed(hash((self.seed, blk.b, h, blk.r0)) & (2 ** 63 - 1))  # int tuples hash alike in every run
            parts.append(torch.rand(G * (blk.r1 - blk.r0), blk.end, generator=gen, dtype=dtype, device=device))
        u = torch.stack(parts)
        return u.ge_(self.rate).to(dtype).mul_(1.0 / (1.0 - self.rate))


@functools.lru_cache(maxsize=1)
def _openmp() -> bool:
    """torch.set_num_threads is per-thread (OpenMP ICV + MKL's thread-local setting) only with OpenMP."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _threads(device: torch.device) -> int:
    return torch.get_num_threads() if device.type == "cpu" and _openmp() else 1


class _Plan:
    """The block loop shared by forward and backward: shapes, block sizes, each block's mask bias, threads."""

    def __init__(self, q, k, v, causal, mask, dropout: Dropout | None = None):
        self.threads = _threads(q.device)
        budget = BLOCK_ELEMS // self.threads  # every thread has a block in flight
        self.B, H, self.Tq, self.D = q.shape
        self.Hkv, self.Tk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = H // self.Hkv  # query head h uses kv head h // G
        self.causal, self.mask4 = causal, as_4d(mask)
        # Rows that see no key exist only under a mask, or causally with more queries than keys.
        self.may_be_empty = mask is not None or (causal and self.Tq > self.Tk)
        rows = min(max(self.Tq, 1), MAX_ROWS)
        per_head = self.G * rows * max(self.Tk, 1)
        if per_head > budget:  # very long keys: fewer rows, still at least MIN_ROWS (so O(MIN_ROWS * T))
            # under dropout the row blocks seed the mask, so they must not depend on the thread count
            rows = min(rows, max(MIN_ROWS, (BLOCK_ELEMS if dropout else budget) // (self.G * self.Tk)))
        self.rows = rows
        heads = max(1, min(self.Hkv, budget // (self.G * rows * max(self.Tk, 1))))
        # at least one (batch row, kv-head group) per thread, so the backward can share them out
        self.heads = min(heads, max(1, math.ceil(self.B * self.Hkv / self.threads)))
        self._triangles = {}  # causal-only diagonal bias, identical for every full block

    def __iter__(self):
        """Every Block: kv heads h0:h1 with their G query heads each, query rows r0:r1, keys :end."""
        for b in range(self.B):
            for h0 in range(0, self.Hkv, self.heads):
                for r0 in range(0, self.Tq, self.rows):
                    r1 = min(r0 + self.rows, self.Tq)
                    end = key_end(self.causal, r1, self.Tq, self.Tk)
                    yield Block(b, h0, min(h0 + self.heads, self.Hkv), r0, r1, end)

    def run(self, body, shared_rows: bool):
        """body(block) for every block that sees a key, in self.threads threads (see the module docstring).

        shared_rows: blocks of one (batch row, kv-head group) write the same rows (dk, dv) and must
        stay on one thread; otherwise blocks are dealt out one by one (causal blocks grow with r0).
        """
        blocks = [blk for blk in self if blk.end > 0]  # end == 0: the rows see no key; outputs stay 0
        if self.threads == 1 or len(blocks) < 2:
            for blk in blocks:
                body(blk)
            return
        if shared_rows:
            groups = list(dict.fromkeys(blk[:2] for blk in blocks))
            if len(groups) < 2:  # one kv head, one batch row: nothing to share out without races
                for blk in blocks:
                    body(blk)
                return
            owner = {g: i % self.threads for i, g in enumerate(groups)}
            shares = [[blk for blk in blocks if owner[blk[:2]] == t] for t in range(self.threads)]
        else:
            shares = [blocks[t::self.threads] for t in range(self.threads)]
        _in_threads(body, [share for share in shares if share])

    def add_bias(self, s, blk: Block):
        """s (hc, G*c, end) += the block's mask bias, broadcast over heads and rows without copying the mask."""
        (b, h0, h1, r0, r1, end), G, mask4 = blk, self.G, self.mask4
        if mask4 is None and self.causal:
            start, bias = self._triangle(s, r0, r1, end)
        else:
            if mask4 is not None:
                mask4 = mask4[b:b + 1] if mask4.shape[0] > 1 else mask4
                mask4 = mask4[:, h0 * G:h1 * G] if mask4.shape[1] > 1 else mask4
            start, bias = block_bias(mask4, self.causal, Rows(r0, r1, self.Tq, self.Tk, end), s.device, s.dtype)
        if bias is None:
            return
        bias = bias[0]  # (H' in {1, hc*G}, c' in {1, c}, w' in {1, end - start})
        bias = bias.view(h1 - h0, G, *bias.shape[1:]) if bias.shape[0] > 1 else bias[None]
        s.view(h1 - h0, G, r1 - r0, end)[..., start:end] += bias

    def _triangle(self, s, r0, r1, end):
        """Causal-only bias: the triangle right of the diagonal, the same for every block of one size (cached)."""
        first_hidden = self.Tk - self.Tq + r0 + 1  # the first key that query r0 may not see
        if first_hidden < 0:  # more queries than keys: an irregular block, not worth caching
            return block_bias(None, True, Rows(r0, r1, self.Tq, self.Tk, end), s.device, s.dtype)
        key = (r1 - r0, end - first_hidden)
        if key not in self._triangles:
            rows = Rows(r0, r1, self.Tq, self.Tk, end)
            self._triangles[key] = block_bias(None, True, rows, s.device, s.dtype)[1]
        return first_hidden, self._triangles[key]


def _in_threads(body, shares):
    """Run body(block) for each share of blocks in its own thread, whose torch ops use one thread each."""
    threads, errors = torch.get_num_threads(), []
    inference = torch.is_inference_mode_enabled()  # per thread too: outputs made under it need it to be written

    def work(share):
        torch.get_num_threads()  # this thread's lazy OpenMP init first, so that the next line sticks
        torch.set_num_threads(1)  # this thread's own setting; also torch's default for threads started meanwhile
        try:
            # grad mode is per thread: without no_grad, ops on q (requires_grad) record a graph
            mode = torch.inference_mode() if inference else torch.no_grad()  # inference_mode(False) enables grad
            with mode:
                for blk in share:
                    body(blk)
        except BaseException as err:  # re-raised in the calling thread
            errors.append(err)
        finally:
            torch.set_num_threads(threads)  # the default for new threads back to what it was

    workers = [threading.Thread(target=work, args=(share,), daemon=True) for share in shares]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def _layout(q, k, v):
    """Compute-dtype views laid out for bmm (copies only for fp16/bf16 or strided inputs).

    q (B, Hkv, G, Tq, D) so a block of G query heads meets its kv head; k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv).
    No pre-transposed or pre-scaled copies: bmm against k[:end].transpose measured as fast as against a
    contiguous k^T here, and baddbmm's alpha applies the scale, so the O(T) buffers stay those of SDPA.
    """
    B, H, Tq, D = q.shape
    ct = compute_dtype(q.dtype)
    qg = q.to(ct).reshape(B, k.shape[1], H // k.shape[1], Tq, D)
    return ct, qg, k.to(ct).contiguous(), v.to(ct).contiguous()


def forward(q, k, v, p: float, scale: float, causal: bool, mask, dropout: Dropout | None = None,
            softcap: float | None = None, out_dtype: torch.dtype | None = None):
    """out (B, H, Tq, Dv) in `out_dtype` (default q's) and N (B, H, Tq) in the compute dtype (0 on rows with no
    visible key)."""
    plan = _Plan(q, k, v, causal, mask, dropout)
    B, Hkv, G, Tq, D, Dv = plan.B, plan.Hkv, plan.G, plan.Tq, plan.D, plan.Dv
    ct, qg, kc, vc = _layout(q, k, v)
    zero = torch.zeros(1, 1, 1, dtype=ct, device=q.device)  # baddbmm's input, with beta = 0
    out = torch.zeros(B, Hkv, G, Tq, Dv, dtype=ct, device=q.device)
    row_max = torch.zeros(B, Hkv, G, Tq, dtype=ct, device=q.device)  # m (0 on empty rows)
    row_norm = torch.ones(B, Hkv, G, Tq, dtype=ct, device=q.device)  # ||exp(s - m)||_p (1 on empty rows)

    def block(blk: Block):
        b, h0, h1, r0, r1, end = blk
        hc, c = h1 - h0, r1 - r0
        qb = qg[b, h0:h1, :, r0:r1].reshape(hc, G * c, D)
        s = torch.baddbmm(zero, qb, kc[b, h0:h1, :end].transpose(1, 2), beta=0.0, alpha=scale)  # (hc, G*c, end)
        if softcap is not None:
            cap_(s, softcap)  # c tanh(s / c), before the mask
        plan.add_bias(s, blk)
        m = s.amax(-1, keepdim=True)  # (hc, G*c, 1)
        if plan.may_be_empty:
            m.masked_fill_(m == float("-inf"), 0.0)  # empty row: exp(-inf - 0) = 0, not NaN
        s.sub_(m)
        if p == 1.0:
            e = s.exp_()
            den = e.sum(-1, keepdim=True)
        elif p == 2.0:  # ||e||_2 in one reduction (a general pow() is ~100x slower than exp on CPU)
            e = s.exp_()
            den = torch.linalg.vector_norm(e, 2.0, dim=-1, keepdim=True)
        else:  # e^p = exp(p (s - m)): a second exp, in place once e is taken
            e = torch.exp(s)
            den = s.mul_(p).exp_().sum(-1, keepdim=True).pow_(1.0 / p)
        if plan.may_be_empty:
            den.masked_fill_(den == 0, 1.0)  # only empty rows have den = 0 (the max term is 1 otherwise)
        if dropout is not None:  # after the normalizer: N is that of the whole row
            e.mul_(dropout.keep(blk, G, e.dtype, e.device))
        out[b, h0:h1, :, r0:r1] = torch.bmm(e, vc[b, h0:h1, :end]).view(hc, G, c, Dv)  # sum_j exp(s - m) v_j
        row_max[b, h0:h1, :, r0:r1] = m.view(hc, G, c)
        row_norm[b, h0:h1, :, r0:r1] = den.view(hc, G, c)

    plan.run(block, shared_rows=False)  # rows with no visible key (end == 0) keep out = 0, N = 0
    out.div_(row_norm.unsqueeze(-1))  # all rows at once
    norm = row_max.add_(row_norm.log_())  # N = m + log ||exp(s - m)||_p
    return out.view(B, Hkv * G, Tq, Dv).to(out_dtype or q.dtype), norm.view(B, Hkv * G, Tq)


def backward(dout, q, k, v, out, norm, p: float, scale: float, causal: bool, mask, dropout: Dropout | None = None,
             softcap: float | None = None):
    """Gradients (dq, dk, dv) of sum(dout * out) for out = A V with A = exp(s - norm); see the module docstring.
    dk and dv in their inputs' dtypes; dq in the compute dtype it accumulates in (fp32 for half inputs): the op
    (custom_ops.py) rounds it once, after SSMax's chain rule where there is one."""
    plan = _Plan(q, k, v, causal, mask, dropout)
    B, Hkv, G, Tq, D, Dv = plan.B, plan.Hkv, plan.G, plan.Tq, plan.D, plan.Dv
    ct, qg, kc, vc = _layout(q, k, v)
    do = dout.to(ct).reshape(B, Hkv, G, Tq, Dv)
    og = out.to(ct).reshape(B, Hkv, G, Tq, Dv)
    neg_norm = norm.to(ct).neg().view(B, Hkv, G, Tq)
    dq = torch.zeros(B, Hkv, G, Tq, D, dtype=ct, device=q.device)
    dk = torch.zeros(B, Hkv, plan.Tk, D, dtype=ct, device=q.device)
    dv = torch.zeros(B, Hkv, plan.Tk, Dv, dtype=ct, device=q.device)

    def block(blk: Block):
        b, h0, h1, r0, r1, end = blk
        hc, c = h1 - h0, r1 - r0
        qb = qg[b, h0:h1, :, r0:r1].reshape(hc, G * c, D)
        dob = do[b, h0:h1, :, r0:r1].reshape(hc, G * c, Dv)
        delta = (dob * og[b, h0:h1, :, r0:r1].reshape(hc, G * c, Dv)).sum(-1, keepdim=True)  # (hc, G*c, 1)
        nn_b = neg_norm[b, h0:h1, :, r0:r1].reshape(hc, G * c, 1)
        if softcap is None:
            s = torch.baddbmm(nn_b, qb, kc[b, h0:h1, :end].transpose(1, 2), alpha=scale)  # s - N, (hc, G*c, end)
        else:  # s = c tanh(scale q.k / c); keep the tanh for the chain rule
            raw = torch.bmm(qb, kc[b, h0:h1, :end].transpose(1, 2)).mul_(scale / softcap)
            s, tanh = capped_minus_norm(nn_b, raw, softcap)
        plan.add_bias(s, blk)
        a = s.exp_() if p in (1.0, 2.0) else torch.exp(s)  # A (hc, G*c, end); hidden keys: exp(-inf) = 0
        ds = torch.bmm(dob, vc[b, h0:h1, :end].transpose(1, 2))  # dA = dO v^T
        if dropout is None:
            dv[b, h0:h1, :end].baddbmm_(a.transpose(1, 2), dob)
        else:
            keep = dropout.keep(blk, G, a.dtype, a.device)
            dv[b, h0:h1, :end].baddbmm_((a * keep).transpose(1, 2), dob)  # (A * M)^T dO
            ds.mul_(keep)  # dA = M * dO v^T
        if p == 1.0:
            ds.sub_(delta).mul_(a)  # A (dA - delta)
        elif p == 2.0:
            ds.addcmul_(a, delta, value=-1.0).mul_(a)  # A (dA - A delta)
        else:
            ds.mul_(a).sub_(s.mul_(p).exp_().mul_(delta))  # A dA - exp(p (s - N)) delta
        if softcap is not None:
            chain_(ds, tanh)  # d/ds_raw = d/ds_capped * (1 - tanh^2)
        dq[b, h0:h1, :, r0:r1] = torch.bmm(ds, kc[b, h0:h1, :end]).view(hc, G, c, D)
        dk[b, h0:h1, :end].baddbmm_(ds.transpose(1, 2), qb)  # sums the G query heads of each kv head

    plan.run(block, shared_rows=True)
    dq = dq.mul_(scale).view(B, Hkv * G, Tq, D)
    dk = dk.mul_(scale)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
