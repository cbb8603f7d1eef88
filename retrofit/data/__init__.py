"""Training data: packed token blocks from text (Hub or local files) and two generated tasks.

    data = build_data(recipe.data, tokenizer, seed=0, eval_lengths=[64, 128])
    batch = data.batch(step, rows=8, length=64)      # a step's global batch: dict of (rows, length) tensors
    data.eval_batches(length=128, batches=2, batch_size=4)
    state = data.state_dict(); data.load_state_dict(state)   # resume at exactly the same position

    counting_batch(batch_size=4, length=32768, alphabet=8, seed=0)   # any length, e.g. for evaluation
    passkey_batch(tokenizer, batch_size=4, length=2048, depth=0.5, seed=0)

Text is tokenized with the model's tokenizer, documents joined with EOS after each, and cut into
blocks of `seq_len` tokens (`data.packing: concat`), or packed whole into rows with position ids restarting
at every document (`documents`, data/packing.py). The validation set is deterministic and concatenated in both:
`val_files`/`val_split`, or else the first `val_blocks` blocks of the stream (held out before any shuffling).
Every process builds the same global batch and trains on its slice, so a run's numbers do not depend on the
number of processes.

Batches are dicts. `lm`: input_ids (B, T), labels (B, T) = input_ids (the loss predicts t+1 from t); packed
documents add position_ids (B, T), labels -100 on each document's first token and the padding.
`passkey`: input_ids, labels (-100 except the answer tokens). `counting`: input_ids, counts (B, T) float,
the running count of the target symbol (position 0, which holds the target, carries no count).
"""

from __future__ import annotations

from ..errors import RetrofitError
from ..recipe import DataSection
from .tasks import (
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_QUESTION,
    CountingData,
    PasskeyData,
    counting_batch,
    passkey_batch,
    passkey_example,
)
from .text import LMData, StreamBlocks, StreamDocuments, TokenBlocks, build_lm, documents, open_texts, tokenize_all


def build_data(section: DataSection, tokenizer=None, *, seed: int = 0, eval_lengths=()):
    """The data object for section.task (see the module docstring for its methods)."""
    if section.task == "counting":
        return CountingData(section.counting.alphabet, seed)
    if section.task == "passkey":
        if tokenizer is None:
            raise RetrofitError("the passkey task needs a tokenizer: set model.tokenizer (a Hub id or folder)")
        return PasskeyData(tokenizer, section.passkey.digits, section.passkey.depth, seed)
    return build_lm(section, tokenizer, seed=seed, val_len=max([section.seq_len, *eval_lengths]))


__all__ = [
    "PASSKEY_FILLER", "PASSKEY_INTRO", "PASSKEY_QUESTION", "CountingData", "LMData", "PasskeyData", "StreamBlocks",
    "StreamDocuments", "TokenBlocks", "build_data", "build_lm", "counting_batch", "documents", "open_texts",
    "passkey_batch", "passkey_example", "tokenize_all",
]
