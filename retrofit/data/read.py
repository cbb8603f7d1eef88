"""Text files as token ids, read piece by piece: never the whole file at once, and only as much as is needed.

    ids = read_tokens("book.txt", tokenizer, "--calibration-text", budget=8192)   # stops after ~8192 tokens
    ids = read_tokens("book.txt", tokenizer, "--data")                            # every token, as int64

A 2 GB text read whole and tokenized into Python ints takes 14-20 GB; here the file is decoded in 1 MiB pieces
(retrofit.errors.iter_utf8: UTF-8 or a one-line error naming the file and byte; only regular files), each piece
is tokenized as it is read, and the ids are kept as an int64 tensor (8 bytes a token). With a budget, reading
stops once the budget is in hand: the rest of the file is never read. A file under 1 MiB is one piece, so its
tokens are exactly those of the whole text.
"""

from __future__ import annotations

import torch

from ..errors import RetrofitError, iter_utf8
from ..memory import available_bytes

PIECE = 1 << 20  # bytes of text decoded and tokenized at a time


def read_tokens(path, tokenizer, what: str = "", budget: int | None = None, *, special: bool = False,
                piece: int = PIECE) -> torch.Tensor:
    """(N,) int64 token ids of the text file at `path`, at most about `budget` + one piece when a budget is given.
    Without a budget every token is kept, and holding them must fit in half the memory available when reading
    starts: past that, a one-line error naming the file (not an out-of-memory kill half-way through).
    `special`: the tokenizer's special tokens (BOS) around the first piece, as tokenizer(text) would add them."""
    room = None if budget is not None else available_bytes() // 16  # int64 ids, twice over while joined
    if budget is not None:  # a few thousand tokens need a few pieces of ~16 bytes a token, not 1 MiB ones
        piece = min(piece, max(1 << 16, 16 * budget))
    parts, count = [], 0
    for i, text in enumerate(iter_utf8(path, what, piece)):
        ids = tokenizer(text, add_special_tokens=special and i == 0, verbose=False)["input_ids"]
        parts.append(torch.tensor(ids, dtype=torch.int64))
        count += len(ids)
        if budget is not None and count >= budget:
            break
        if room is not None and count > room:
            raise RetrofitError(f"{what} {path} holds more tokens than fit in memory (over {count:,} read, "
                                f"{available_bytes() / 2 ** 30:,.1f} GiB available); give a shorter text")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
