"""RULER-style synthetic tasks (Hsieh et al. 2024), generated offline from a seed, at an exact token length.

    hay = Haystack(tokenizer, texts)            # texts: the --data documents, or None for the built-in filler
    inst = make_instance("niah", tokenizer, hay, length=4096, depth=0.5, index=0, seed=0, needle="number")
    inst["input"], inst["outputs"]              # the prompt text, the strings a correct answer contains

Tasks: niah (one needle "One of the special magic {kind}s for {key} is: {value}."), niah_multikey (three
distractor needles with other keys), niah_multivalue (four values for the one key, all asked), niah_multiquery
(four keys asked), vt (a chain of variable assignments; which variables hold the value), cwe (a numbered word
list; its 10 most common words), fwe (coded words with Zipf frequencies; the 3 most frequent).

Framing: RULER's completion framing for base models: the task text, then the question, then an answer prefix
the model continues (no chat template, no few-shot example). The wording is retrofit's own.

Length: niah and vt prompts are exactly `length` tokens when the tokenizer reads the text back as it was built
(a character tokenizer always does); with BPE a merge across a needle's edge can move it by a token or two
(GPT-2's tokenizer on Moby-Dick at 4K and 16K: exactly L, or 1-2 under). A body that reads back longer than
planned is rebuilt with less haystack. cwe and fwe end at a whole list item: at most one item under `length`.
The target needle of the niah tasks starts at haystack token round(depth * n), n the haystack's tokens (other
needles not counted).
"""

from __future__ import annotations

import functools
import re
import uuid
import zlib
from collections.abc import Sequence

import numpy as np

from ..errors import RetrofitError

TASKS = ("niah", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
DEPTH_TASKS = TASKS[:4]
MAX_NEW_TOKENS = {"niah": 32, "niah_multikey": 32, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 30,
                  "cwe": 120, "fwe": 50}
STOP = "\n\n"  # generation stops at a blank line (and at EOS), in retrofit eval and in the exported harness tasks
NEEDLE_KINDS = ("word", "number", "uuid")
DESCRIPTIONS = {
    "niah": "one needle 'One of the special magic {kind}s for KEY is: VALUE.' at each depth; found or not",
    "niah_multikey": "the needle among 3 distractor needles with other keys; found or not",
    "niah_multivalue": "4 values for one key, all asked; fraction of the 4 returned",
    "niah_multiquery": "4 keys asked at once; fraction of their 4 values returned",
    "vt": "variable tracking: a chain VAR A = 12345 ... VAR B = VAR A; fraction of the chain's 5 variables named",
    "cwe": "common-words extraction from a numbered word list; fraction of the 10 most common words named",
    "fwe": "frequent-words extraction from Zipf-distributed coded words; fraction of the 3 most frequent named",
}
# the built-in haystack when no --data is given: one paragraph, repeated
FILLER = ("The lamp by the window stays lit through the evening. A kettle hums quietly on the stove. "
          "Rain taps the roof for a while and then stops. ")

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def instance_rng(seed: int, task: str, length: int, depth: float | None, index: int) -> np.random.Generator:
    """The generator of one instance: the same (seed, task, length, depth, index) always draws the same."""
    d = 10_001 if depth is None else round(depth * 10_000)
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, d, index])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


class Haystack:
    """The text needles are hidden in: the sentences of `texts` in order from a seeded sentence, or FILLER
    repeated. Sentences are tokenized once, so cutting many instances costs one tokenization of the span used."""

    def __init__(self, tokenizer, texts: list[str] | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise RetrofitError("the RULER tasks need a fast tokenizer (token offsets); this one is a slow "
                                "(Python) tokenizer: pass --tokenizer with a tokenizer.json")
        self.tokenizer = tokenizer
        self.sentences = None
        if texts:
            self.sentences = [s for t in texts for s in re.split(r"(?<=[.!?])\s+", " ".join(t.split())) if s]
            counts = [len(x) for x in tokenizer([" " + s for s in self.sentences], add_special_tokens=False,
                                                verbose=False)["input_ids"]]
            self.after = np.cumsum(counts[::-1])[::-1]  # tokens from each sentence to the end

    def take(self, tokens: int, rng: np.random.Generator) -> tuple[str, list[int]]:
        """(text of exactly `tokens` tokens, each token's start offset in it)."""
        if self.sentences is None:
            unit = len(_encode(self.tokenizer, FILLER))
            text = FILLER * (tokens // max(unit, 1) + 2)
        else:
            starts = np.flatnonzero(self.after >= tokens + 8)  # a margin: joined text may merge tokens
            if tokens > 0 and len(starts) == 0:
                raise RetrofitError(f"the --data text is too short for the asked length: {int(self.after[0])} "
                                    f"tokens, {tokens} needed for the haystack; give more text or shorter --lengths")
            first = int(rng.choice(starts)) if len(starts) else 0
            last = first + int(np.searchsorted(-self.after[first:], -(self.after[first] - tokens - 8)))
            text = " ".join(self.sentences[first:last + 2])
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = [a for a, _ in enc["offset_mapping"][:tokens + 1]]
        return text[:offsets[tokens]] if tokens < len(offsets) else text, offsets[:tokens]


def _insert(text: str, starts: list[int], pieces: list[tuple[int, str]]) -> str:
    """`text` with each (token position, string) inserted before that token (in order of position)."""
    out, at = [], 0
    for pos, piece in sorted(pieces, key=lambda p: p[0]):
        cut = starts[pos] if pos < len(starts) else len(text)
        out += [text[at:cut], piece]
        at = cut
    return "".join(out + [text[at:]])


def pseudo_words(rng: np.random.Generator, n: int, syllables: int = 3) -> list[str]:
    """`n` distinct pronounceable made-up words (consonant-vowel syllables), in draw order."""
    seen: dict[str, None] = {}
    while len(seen) < n:
        s = rng.integers(0, len(_CONSONANTS), syllables), rng.integers(0, len(_VOWELS), syllables)
        seen.setdefault("".join(_CONSONANTS[c] + _VOWELS[v] for c, v in zip(*s)), None)
    return list(seen)


def _value(kind: str, rng: np.random.Generator) -> str:
    if kind == "number":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    if kind == "uuid":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    return pseudo_words(rng, 1)[0]


def _finish(task, tokenizer, length, head, body, question, outputs, **extra) -> dict:
    """The instance dict: prompt text, its token count, the references, and where the context lies."""
    text = head + body + question
    n = len(_encode(tokenizer, text))
    return {"task": task, "length": length, "input": text, "tokens": n, "outputs": outputs,
            "max_new_tokens": MAX_NEW_TOKENS[task], "stop": STOP,
            "context": [len(_encode(tokenizer, head)), n - len(_encode(tokenizer, question))], **extra}


def _fit(build, room: int, tokenizer) -> tuple[str, int]:
    """Retry `build(room)` with a smaller room while the joined text reads back longer than planned."""
    for _ in range(4):
        body, planned = build(room)
        over = len(_encode(tokenizer, body)) - planned
        if over <= 0:
            return body, planned
        room -= over
    return build(room)


def niah(task, tokenizer, hay, length, depth, rng, kind="number") -> dict:
    """A needle task: the asked needle's first token at haystack position round(depth * haystack tokens)."""
    keys_asked = 4 if task == "niah_multiquery" else 1
    values_per_key = 4 if task == "niah_multivalue" else 1
    keys = ["-".join(pseudo_words(rng, 2, 2)) for _ in range(keys_asked + (3 if task == "niah_multikey" else 0))]
    values = [[_value(kind, rng) for _ in range(values_per_key)] for _ in keys]
    needles = [f" One of the special magic {kind}s for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    asked = ", ".join(keys[:keys_asked])
    head = (f"Some special magic {kind}s are hidden in the text below. Remember them: you will be asked about "
            f"the {kind}s afterwards.\n")
    question = (f"\nQuestion: which special magic {kind}s for {asked} are mentioned in the text above?\n"
                f"Answer: The special magic {kind}s for {asked} mentioned in the text above are")
    fixed = len(_encode(tokenizer, head)) + len(_encode(tokenizer, question))
    lengths = [len(_encode(tokenizer, s)) for s in needles]
    room = length - fixed - sum(lengths)
    if room < 1:
        raise RetrofitError(f"{task} length {length} is too short: the question and needles take "
                            f"{fixed + sum(lengths)} tokens")
    others = [int(p) for p in rng.integers(0, room + 1, len(needles) - 1)]

    def build(room):
        text, starts = hay.take(room, rng_copy(rng))
        target = round(depth * room)
        return _insert(text, starts, [(target, needles[0])] + list(zip([min(p, room) for p in others],
                                                                        needles[1:]))), room + sum(lengths)

    body, _ = _fit(build, room, tokenizer)
    outputs = [v for vs in values[:keys_asked] for v in vs]
    return _finish(task, tokenizer, length, head, body, question, outputs, depth=depth, needle=needles[0].strip())


def rng_copy(rng: np.random.Generator) -> np.random.Generator:
    """A generator in the same state (a retried build draws the same haystack offset)."""
    g = np.random.default_rng()
    g.bit_generator.state = rng.bit_generator.state
    return g


def vt(tokenizer, hay, length, rng, hops: int = 4) -> dict:
    """Variable tracking: VAR A = N, then VAR B = VAR A, ... spread evenly through the haystack."""
    names = []
    while len(names) < hops + 1:
        name = "".join(chr(ord("A") + int(i)) for i in rng.integers(0, 26, 5))
        names += [name] if name not in names else []
    number = str(int(rng.integers(10_000, 100_000)))
    lines = [f" VAR {names[0]} = {number}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    head = "Memorize and track the chain of variable assignments hidden in the text below.\n"
    question = (f"\nQuestion: which variables are assigned the value {number} in the text above?\n"
                f"Answer: Following the chain of assignments in the text above, {len(names)} variables are "
                f"assigned the value {number}; they are:")
    lengths = [len(_encode(tokenizer, s)) for s in lines]
    room = length - len(_encode(tokenizer, head)) - len(_encode(tokenizer, question)) - sum(lengths)
    if room < 1:
        raise RetrofitError(f"vt length {length} is too short: the question and the chain take "
                            f"{length - room} tokens")

    def build(room):
        text, starts = hay.take(room, rng_copy(rng))
        at = [round((i + 0.5) / len(lines) * room) for i in range(len(lines))]
        return _insert(text, starts, list(zip(at, lines))), room + sum(lengths)

    body, _ = _fit(build, room, tokenizer)
    return _finish("vt", tokenizer, length, head, body, question, names, depth=None)


def _longest(make, tokenizer, room: int, most: int) -> tuple[str, int]:
    """(text, n) for the largest n <= most whose make(n) fits in `room` tokens (binary search; make grows in n)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_encode(tokenizer, make(mid))) <= room:
            lo = mid
        else:
            hi = mid - 1
    return make(lo), lo


def cwe(tokenizer, length, rng, common: int = 10) -> dict:
    """A numbered list where `common` words appear C times each and the others U < C times each."""
    head = ("Below is a numbered list of words. Some of them appear more often than others; remember the ones "
            "that appear most often.\n")
    question = (f"\nQuestion: what are the {common} most common words in the list above?\n"
                f"Answer: The {common} words that appear most often in the list are:")
    room = length - len(_encode(tokenizer, head)) - len(_encode(tokenizer, question))
    item = len(_encode(tokenizer, f"{length // 4}. {pseudo_words(rng_copy(rng), 1)[0]}\n"))
    many = max(1, room // (4 * common * item))
    freq_common, freq_rare = min(30, max(2, many)), min(3, max(1, many // 4))
    words = pseudo_words(rng, common + room // max(item, 1) + 1)
    order_seed = int(rng.integers(2**31))

    def make(rare: int) -> str:
        items = [w for w in words[:common] for _ in range(freq_common)]
        items += [w for w in words[common:common + rare] for _ in range(freq_rare)]
        order = np.random.default_rng(order_seed).permutation(len(items))
        return "".join(f"{i + 1}. {items[j]}\n" for i, j in enumerate(order))

    if len(_encode(tokenizer, make(0))) > room:
        raise RetrofitError(f"cwe length {length} is too short for {common} words twice each: ask a longer length")
    body, _ = _longest(make, tokenizer, room, len(words) - common)
    return _finish("cwe", tokenizer, length, head, body, question, words[:common], depth=None)


def fwe(tokenizer, length, rng, alpha: float = 2.0, vocab: int = 50, top: int = 3) -> dict:
    """Coded words with counts proportional to 1 / rank**alpha (the top `top` + 1 strictly decreasing)."""
    head = ("Read the coded text below and keep track of how often each coded word appears: find the three "
            "coded words that appear most often.\n")
    question = ("\nQuestion: ignore the dots '....'. Which three coded words appear most often in the coded text "
                "above?\nAnswer: According to the coded text above, the three most frequent coded words are:")
    room = length - len(_encode(tokenizer, head)) - len(_encode(tokenizer, question))
    coded = pseudo_words(rng, vocab, 2)
    weights = 1.0 / np.arange(1, vocab + 1) ** alpha
    order_seed = int(rng.integers(2**31))

    def make(n: int) -> str:
        counts = np.floor(n * weights / weights.sum()).astype(int)
        for r in range(top, -1, -1):  # strictly decreasing through rank top + 1: the answer is unambiguous
            counts[r] = max(counts[r], counts[r + 1] + 1)
        words = [w for w, c in zip(coded, counts) for _ in range(c)]
        words = [words[j] for j in np.random.default_rng(order_seed).permutation(len(words))]
        return "".join(f" {w}" + (" ...." if i % 8 == 7 else "") for i, w in enumerate(words))

    if len(_encode(tokenizer, make(0))) > room:
        raise RetrofitError(f"fwe length {length} is too short for its coded words: ask a longer length")
    body, _ = _longest(make, tokenizer, room, room)
    return _finish("fwe", tokenizer, length, head, body, question, coded[:top], depth=None)


def make_instance(task: str, tokenizer, hay: Haystack, *, length: int, depth: float | None = None, index: int = 0,
                  seed: int = 0, needle: str = "number") -> dict:
    """One instance of `task` at `length` tokens (depth for the niah tasks), the same for the same arguments."""
    if task not in TASKS:
        raise RetrofitError(f"unknown RULER task {task!r}: choose from {', '.join(TASKS)}")
    if needle not in NEEDLE_KINDS:
        raise RetrofitError(f"needle kind {needle!r}: choose word, number or uuid")
    rng = instance_rng(seed, task, length, depth if task in DEPTH_TASKS else None, index)
    if task in DEPTH_TASKS:
        if depth is None or not 0.0 <= depth <= 1.0:
            raise RetrofitError(f"depth {depth}: give depths between 0 (start) and 1 (end)")
        inst = niah(task, tokenizer, hay, length, depth, rng, needle)
    elif task == "vt":
        inst = vt(tokenizer, hay, length, rng)
    else:
        inst = (cwe if task == "cwe" else fwe)(tokenizer, length, rng)
    return {**inst, "index": index, "seed": seed}


class Instances(Sequence):
    """Every instance of `task` at `length`: samples per depth (niah tasks) or samples (the others), in that
    order. Built when read, one at a time, never all at once (an instance is `length` tokens of text; --samples
    1000000 must not build them first); the first is built here, so a haystack too short fails before any model
    runs. `group(depth)` yields one depth's instances."""

    def __init__(self, task: str, tokenizer, hay: Haystack, *, length: int, depths=(0.5,), samples: int = 8,
                 seed: int = 0, needle: str = "number"):
        self.depths = list(depths) if task in DEPTH_TASKS else [None]
        self.samples = samples
        self._make = functools.partial(make_instance, task, tokenizer, hay, length=length, seed=seed, needle=needle)
        self[0]

    def __len__(self) -> int:
        return len(self.depths) * self.samples

    def __getitem__(self, k: int) -> dict:
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        depth, index = divmod(k % len(self), self.samples)
        return self._make(depth=self.depths[depth], index=index)

    def group(self, depth):
        for i in range(self.samples):
            yield self._make(depth=depth, index=i)


def instances(task: str, tokenizer, hay: Haystack, *, length: int, depths=(0.5,), samples: int = 8, seed: int = 0,
              needle: str = "number") -> Instances:
    """Every instance of `task` at `length` (see Instances: built as read)."""
    return Instances(task, tokenizer, hay, length=length, depths=depths, samples=samples, seed=seed, needle=needle)
