"""Document-aware packing (`data.packing: documents`): whole documents in each row, positions restarting at each.

    rows = pack_documents(tokens, lengths, seq_len=1024, pad=eos)    # (N, 3, seq_len): ids, position ids, labels
    batch = packed_batch(rows, rows=8, length=512)                   # input_ids, position_ids, labels (8, 512)

The convention is transformers' packed-sequence format (as TRL's padding-free collator and flash-attention's
varlen path use it): no attention_mask, and `position_ids` that restart at 0 at every document. With no
attention mask and no cache, transformers' `create_causal_mask` finds the documents from the resets
(`find_packed_sequence_indices`) and builds a block-causal mask through the mask function registered for the
implementation (retrofit registers sdpa's and eager's for its own): each query sees only its own document's keys,
so p-softmax's normalizer, SSMax's n (counted from the mask) and softmax+1's sink see only that document; on
flash-attention the same position ids select its varlen path. A forward WITH a KV cache ignores position resets
(transformers checks `cache is None`): callers pass `use_cache=False`.

Labels: each segment's first token is -100, so the token before it (the previous document's EOS) is not
scored on a document it cannot see (TRL's DataCollatorWithFlattening does the same); the padding that fills a
row's end is its own segment (EOS tokens, positions from 0), never scored.
"""

from __future__ import annotations

import bisect

import torch


def pieces(lengths: list[int], seq_len: int) -> list[tuple[int, int]]:
    """(start, length) in the flat token stream of every piece: a document longer than seq_len is split into
    seq_len pieces and a shorter rest (each piece a document of its own: it cannot see the piece before it)."""
    out, start = [], 0
    for n in lengths:
        for lo in range(0, n, seq_len):
            out.append((start + lo, min(seq_len, n - lo)))
        start += n
    return out


def plan_rows(sizes: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: each piece (longest first) into the row with the least free space that holds it,
    else a new row. Returns the piece indices of every row. Deterministic (ties keep the input order)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, row), sorted
    for i in order:
        k = bisect.bisect_left(free, (sizes[i], -1))
        if k == len(free):
            rows.append([])
            row, space = len(rows) - 1, seq_len
        else:
            space, row = free.pop(k)
        rows[row].append(i)
        if space - sizes[i] > 0:
            bisect.insort(free, (space - sizes[i], row))
    return rows


def pack_documents(tokens: torch.Tensor, lengths: list[int], seq_len: int, pad: int) -> torch.Tensor:
    """Rows of whole documents (tokens: the documents back to back, (N,); lengths: each one's token count):
    (rows, 3, seq_len) int64 holding input_ids, position_ids and labels (see the module docstring)."""
    spans = pieces(lengths, seq_len)
    plan = plan_rows([n for _, n in spans], seq_len)
    out = torch.empty(len(plan), 3, seq_len, dtype=torch.int64)
    ramp = torch.arange(seq_len)
    for r, members in enumerate(plan):
        at = 0
        for i in sorted(members):  # in corpus order within the row
            start, n = spans[i]
            out[r, 0, at:at + n] = tokens[start:start + n]
            out[r, 1, at:at + n] = ramp[:n]
            out[r, 2, at:at + n] = tokens[start:start + n]
            out[r, 2, at] = -100
            at += n
        out[r, 0, at:], out[r, 1, at:], out[r, 2, at:] = pad, ramp[:seq_len - at], -100
    return out


def packed_batch(blocks: torch.Tensor, rows: int, length: int) -> dict:
    """`rows` rows of `length` from packed blocks (n, 3, seq_len), n * seq_len = rows * length. A block cut into
    shorter rows (a staged length) splits a document like a long one: the row's leading piece restarts at 0."""
    ids, positions, labels = (blocks[:, k].reshape(rows, length) for k in range(3))
    leading = (positions == 0).cumsum(1) == 0  # (rows, length): the piece before the row's first reset
    positions = torch.where(leading, positions - positions[:, :1], positions)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}
