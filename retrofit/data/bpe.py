"""A small byte-level BPE tokenizer trained on the experiment's own text: `retrofit tokenizer train`.

    retrofit tokenizer train --data books/emma.txt books/mobydick.txt --vocab-size 4096 --out runs/bpe4096

Why: a small model trained from scratch on the CPU spends most of its time in the output layer when the
vocabulary is GPT-2's 50257 tokens (hidden 128: the head is 6.4 M parameters, a 4-layer body 0.8 M). A
4096-token BPE trained on the training books makes the head 0.5 M, so the steps go to the attention
being compared. Byte-level, so every text round-trips exactly and nothing is unknown.

Deterministic: the same files (in the same order) and vocabulary size give byte-identical files. The
folder holds tokenizer.json and tokenizer_config.json (eos `<|endoftext|>`, which the text pipeline puts
after each document); `retrofit.load.load_tokenizer(folder)` and a recipe's `model.tokenizer` read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..bounds import MOST, check_size
from ..errors import RetrofitError, check_utf8
from ..io.atomic import atomic_folder

EOS = "<|endoftext|>"
SMALLEST = 256 + 1  # the 256 byte symbols and EOS: a smaller vocabulary cannot hold every text


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < SMALLEST:
        raise RetrofitError(f"--vocab-size must be >= {SMALLEST} (256 bytes + {EOS}), got {vocab_size}")
    check_size(vocab_size, "--vocab-size", MOST["vocab"], least=SMALLEST)  # the trainer aborts the process beyond


def train_bpe(files: list, vocab_size: int, out, progress: bool = False) -> Path:
    """Train a byte-level BPE of `vocab_size` tokens (EOS included) on `files` and save it to `out` (new or
    empty; written whole or not at all). Returns the folder. `progress`: the tokenizers library's own bars
    (reading the files, counting pairs, merging)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    if not files:
        raise RetrofitError("--data needs at least one text file")
    for path in files:
        check_utf8(path, "--data")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(Path(f).expanduser()) for f in files], trainer)
    if tok.get_vocab_size() != vocab_size:  # the text has fewer distinct merges than asked for
        print(f"[tokenizer] the text yields {tok.get_vocab_size()} tokens, fewer than the {vocab_size} asked for")
    with atomic_folder(out, "--out") as tmp:
        tok.save(str(tmp / "tokenizer.json"), pretty=True)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
                  "unk_token": None, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
                  "retrofit": {"vocab_size": tok.get_vocab_size(), "trained_on": [Path(f).name for f in files]}}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return Path(out).expanduser()
