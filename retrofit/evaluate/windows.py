"""Evaluation data: windows cut from documents, log-spaced position buckets, token files.

A window of length L is L + 1 consecutive tokens of one document: the model reads the first L and
is scored on predicting tokens 1..L, so the last prediction has seen exactly L tokens. Windows are
cut without overlap from the start of each document; `max_tokens` keeps a subset dealt evenly
across the documents and evenly spaced within each.
They depend only on the tokens, so every model with the same tokenizer sees the same windows.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from transformers.utils import logging

from ..data.read import read_tokens
from ..errors import RetrofitError
from ..recipe import load_json


def window_starts(documents: list, length: int, max_tokens: int | None = None,
                  max_windows: int | None = None) -> list[tuple[int, int]]:
    """(document index, start) of each window, in document order. Uncapped: every non-overlapping window. Capped
    at N = max(1, max_tokens // length) windows: the N are dealt round-robin over the documents that have windows
    left (so 3 windows from 3 documents are one from each, and the interval sees variation between documents),
    and each document's share is evenly spaced within it; with one document this is the evenly spaced subset.
    `max_windows` caps the count the same way whatever the length (the smaller cap wins)."""
    per_document = [list(range(0, len(doc) - length, length + 1)) for doc in documents]
    total = sum(map(len, per_document))
    if not total:
        longest = max((len(doc) for doc in documents), default=0)
        raise RetrofitError(f"length {length} needs {length + 1} tokens in one document but the longest has "
                            f"{longest}: use shorter --lengths or longer --data")
    keep = total if not max_tokens else max(1, min(total, max_tokens // length))
    keep = min(keep, max_windows) if max_windows else keep
    shares = [0] * len(documents)
    while sum(shares) < keep:  # one more window to each document that still has one, in document order
        for d, starts in enumerate(per_document):
            if shares[d] < len(starts) and sum(shares) < keep:
                shares[d] += 1
    return [(d, starts[i * len(starts) // share]) for d, (starts, share) in enumerate(zip(per_document, shares))
            for i in range(share)]


def cut_windows(documents: list, length: int, max_tokens: int | None = None, max_windows: int | None = None
                ) -> torch.Tensor:
    """Non-overlapping (N, length + 1) windows from the documents, as `window_starts` chooses them."""
    return stack_windows(documents, window_starts(documents, length, max_tokens, max_windows), length)


def stack_windows(documents: list, starts: list[tuple[int, int]], length: int) -> torch.Tensor:
    """(N, length + 1) token ids of the windows at `starts` ((document, start) pairs)."""
    return torch.stack([torch.as_tensor(documents[d][s:s + length + 1], dtype=torch.long) for d, s in starts])


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced [start, end) position buckets: [0,1), [1,2), [2,4), [4,8), ... up to length."""
    edges = [0] + [2 ** k for k in range(math.ceil(math.log2(length)) + 1) if 2 ** k < length] + [length]
    return list(zip(edges[:-1], edges[1:]))


def bucket_rows(sums: torch.Tensor, per_position: int, key: str, skip_first=False) -> list[dict]:
    """(L,) per-position sums over `per_position` items each -> log-spaced bucket means."""
    buckets = position_buckets(sums.shape[0])[1 if skip_first else 0:]
    return [{"start": a, "end": b, key: sums[a:b].sum().item() / (per_position * (b - a)),
             "tokens": per_position * (b - a)} for a, b in buckets]


def read_token_file(path) -> list[list[int]]:
    """A .json file holding token ids: one list (one document) or a list of lists (documents)."""
    try:
        data = load_json(Path(path).read_text(), f"token file {path}")
    except RetrofitError:
        raise
    except (OSError, ValueError) as err:
        raise RetrofitError(f"cannot read token file {path}: {err}; give a JSON list of token ids") from None
    documents = data if isinstance(data, list) and data and isinstance(data[0], list) else [data]
    if not all(isinstance(doc, list) and all(isinstance(t, int) for t in doc) for doc in documents):
        raise RetrofitError(f"{path} must hold a JSON list of token ids or a list of such lists")
    return documents


def tokenizer_fingerprint(tokenizer) -> str:
    """Models whose tokenizers share this fingerprint share their tokenized data and windows."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps([type(tokenizer).__name__, vocab]).encode()).hexdigest()[:12]


def tokenize_files(tokenizer, paths) -> list[list[int]]:
    """Each text file is one document, tokenized without special tokens."""
    documents = []
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "sequence length is longer than the model's maximum": windows handle that
    try:
        for path in paths:
            documents.append(read_tokens(path, tokenizer, "--data"))  # piece by piece, int64: never the text whole
    finally:
        logging.set_verbosity(verbosity)
    return documents
