"""`retrofit tokenizer train --data FILES --vocab-size N --out DIR`: a small byte-level BPE on your own text.

    retrofit tokenizer train --data data/books/emma.txt data/books/mobydick.txt --vocab-size 4096 --out runs/bpe4096

A recipe then names the folder as its `model.tokenizer` (recipes/avnorm-post.yaml). Deterministic: the same
files and size give identical files (retrofit.data.bpe).
"""

from __future__ import annotations

import argparse

from . import add_progress_flag, check_out, check_text_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["train"], help="train: a byte-level BPE on --data")
    parser.add_argument("--data", nargs="+", required=True, help="UTF-8 text files to train on (order matters)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokens, <|endoftext|> included (default 4096)")
    parser.add_argument("--out", required=True, help="new or empty folder for tokenizer.json + tokenizer_config.json")
    add_progress_flag(parser, "no progress bars (reading the files, merging)")


def run(args) -> int:
    from ..data.bpe import check_vocab_size, train_bpe

    check_vocab_size(args.vocab_size)  # before the files are read
    check_text_files(args.data, "--data")
    out = check_out(args.out, "--out", empty=True)
    folder = train_bpe(args.data, args.vocab_size, out, progress=not args.no_progress)
    print(f"tokenizer: {folder} ({args.vocab_size} tokens; set model.tokenizer: {folder})")
    return 0
