"""Generated tasks: the L2-softmax post's counting task and passkey retrieval, at any length.

    counting_batch(batch_size=4, length=32768, alphabet=8, seed=0)   # any length, e.g. for evaluation
    passkey_batch(tokenizer, batch_size=4, length=2048, depth=0.5, seed=0)

`counting`: input_ids, counts (B, T) float, the running count of the target symbol (position 0, which
holds the target, carries no count). `passkey`: input_ids, labels (-100 except the answer tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import RetrofitError


def seeded_generator(*seeds: int) -> torch.Generator:
    """A torch generator seeded by mixing several integers (e.g. run seed, step) without collisions."""
    mixed = np.random.SeedSequence([int(s) % 2**63 for s in seeds]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


# ---- counting: the L2-softmax post's task ---------------------------------------------------------------------------

def counting_batch(batch_size: int, length: int, *, alphabet: int = 8, seed: int = 0,
                   generator: torch.Generator | None = None) -> dict:
    """Position 0 holds the target symbol; positions 1.. are uniform symbols from 0..alphabet-1.

    counts[b, t] = number of positions 1..t whose symbol equals the target (counts[:, 0] = 0, unused).
    The same (batch_size, length, alphabet, seed) always gives the same batch.
    """
    if length < 2 or batch_size < 1:
        raise RetrofitError(f"counting needs length >= 2 and batch_size >= 1, got {length} and {batch_size}")
    g = generator or seeded_generator(seed, length, alphabet)
    ids = torch.randint(0, alphabet, (batch_size, length), generator=g)  # (B, T)
    hits = (ids[:, 1:] == ids[:, :1]).float()                             # (B, T-1)
    counts = torch.cat([torch.zeros(batch_size, 1), hits.cumsum(1)], 1)   # (B, T)
    return {"input_ids": ids, "counts": counts}


class CountingData:
    task = "counting"

    def __init__(self, alphabet: int, seed: int):
        self.alphabet, self.seed = alphabet, seed

    def batch(self, step: int, rows: int, length: int) -> dict:
        return counting_batch(rows, length, alphabet=self.alphabet,
                              generator=seeded_generator(self.seed, 1, step, length))

    def eval_batches(self, length: int, batches: int, batch_size: int) -> list[dict]:
        return [counting_batch(batch_size, length, alphabet=self.alphabet,
                               generator=seeded_generator(self.seed, 2, i, length))
                for i in range(batches)]

    def calibration(self, tokens: int, length: int) -> list[dict]:
        rows = max(1, -(-tokens // length))
        return [counting_batch(rows, length, alphabet=self.alphabet, generator=seeded_generator(self.seed, 3, length))]

    def state_dict(self) -> dict:
        return {}  # generated from (seed, step): nothing to remember

    def load_state_dict(self, state: dict) -> None:
        pass


# ---- passkey: a number hidden in filler text -----------------------------------------------------------------------

PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it. "
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def passkey_example(tokenizer, length: int, depth: float, key: str) -> dict:
    """Exactly `length` tokens: intro, filler with the key at `depth` (0..1), the question, the answer."""
    intro, question = _encode(tokenizer, PASSKEY_INTRO), _encode(tokenizer, PASSKEY_QUESTION)
    needle = _encode(tokenizer, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    answer = _encode(tokenizer, f" {key}")
    room = length - len(intro) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise RetrofitError(f"passkey length {length} is too short: at least {length - room} tokens are needed")
    unit = _encode(tokenizer, PASSKEY_FILLER)
    filler = (unit * (room // max(len(unit), 1) + 1))[:room]
    at = round(depth * room)
    ids = intro + filler[:at] + needle + filler[at:] + question + answer
    labels = [-100] * (length - len(answer)) + answer
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "answer": key}


def passkey_batch(tokenizer, batch_size: int, length: int, *, depth: float | None = None, digits: int = 5,
                  seed: int = 0, generator: torch.Generator | None = None) -> dict:
    """input_ids (B, T), labels (B, T) with -100 except the answer tokens, answers (list of str).
    depth None draws a uniform depth per example."""
    g = generator or seeded_generator(seed, length, digits)
    rows = []
    for _ in range(batch_size):
        key = str(int(torch.randint(10 ** (digits - 1), 10 ** digits, (1,), generator=g)))
        d = float(torch.rand(1, generator=g)) if depth is None else depth
        rows.append(passkey_example(tokenizer, length, d, key))
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows]), "answers": [r["answer"] for r in rows]}


class PasskeyData:
    task = "passkey"

    def __init__(self, tokenizer, digits: int, depth: float | None, seed: int):
        self.tokenizer, self.digits, self.depth, self.seed = tokenizer, digits, depth, seed

    def _batch(self, rows, length, g):
        b = passkey_batch(self.tokenizer, rows, length, depth=self.depth, digits=self.digits, generator=g)
        return {"input_ids": b["input_ids"], "labels": b["labels"]}

    def batch(self, step: int, rows: int, length: int) -> dict:
        return self._batch(rows, length, seeded_generator(self.seed, 1, step, length))

    def eval_batches(self, length: int, batches: int, batch_size: int) -> list[dict]:
        return [self._batch(batch_size, length, seeded_generator(self.seed, 2, i, length)) for i in range(batches)]

    def calibration(self, tokens: int, length: int) -> list[dict]:
        return [self._batch(max(1, -(-tokens // length)), length, seeded_generator(self.seed, 3, length))]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
