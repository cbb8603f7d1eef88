"""Text for language modelling: Hub datasets and local files, tokenized and packed into blocks.

    data = build_lm(recipe.data, tokenizer, seed=0, val_len=1024)

Text is tokenized with the model's tokenizer, documents joined with EOS after each, and cut into
blocks of `seq_len` tokens (`data.packing: concat`), or packed whole into rows with position ids restarting
at every document (`documents`, data/packing.py). The validation set is deterministic and concatenated in both:
`val_files`/`val_split`, or else the first `val_blocks` blocks of the stream (held out before any shuffling).
Every process builds the same global batch and trains on its slice, so a run's numbers do not depend on the
number of processes. Given both data.dataset and data.files, the files train when they are here (the offline path)
and the Hub dataset when none is (sources).
`lm` batches: input_ids (B, T), labels (B, T) = input_ids (the loss predicts t+1 from t); packed documents
add position_ids (B, T) and label -100 on each document's first token and on the padding.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

import torch

from ..errors import RetrofitError, books_hint, check_regular, check_utf8
from ..recipe import DataSection
from .packing import pack_documents, packed_batch
from .tasks import seeded_generator

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# ---- text: Hub datasets and local files, packed into blocks ---------------------------------------------------------

def _expand_files(patterns: list[str], key: str) -> list[str]:
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise RetrofitError(f"data.{key}: no such file: {pattern}{books_hint(pattern)}")
        files.extend(matched)
    for f in files:
        if os.path.isdir(f):
            raise RetrofitError(f"data.{key}: {f} is a folder; list its files or use a glob, e.g. {f}/*.txt")
        check_regular(f, f"data.{key}: {f}")  # a FIFO or a device has size 0 but is not empty
        if os.path.getsize(f) == 0:
            raise RetrofitError(f"data.{key}: {f} is empty; remove it from the list or give it text")
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - BUILDERS.keys()
    if unknown:
        raise RetrofitError(f"data.{key}: cannot read {', '.join(sorted(unknown))} files; use .txt, .jsonl or .parquet")
    if len({BUILDERS[s] for s in suffixes}) > 1:
        raise RetrofitError(f"data.{key}: mixes file types ({', '.join(sorted(suffixes))}); use one type per list")
    for f in files:
        if BUILDERS[Path(f).suffix.lower()] != "parquet":
            check_utf8(f, f"data.{key}")  # the one text rule (retrofit.errors): UTF-8 or a one-line error
    return files


def sources(section: DataSection) -> tuple[list[str] | None, list[str] | None, str | None]:
    """(files, val_files, val_split) this run reads; files None: the Hub's data.dataset trains. Given both
    data.dataset and data.files, the files are the offline path: they train, validated on data.val_files, when every
    one is here; the Hub dataset, validated on data.val_split, when none is; some but not all is an error naming the
    first missing one (a partial copy is a mistake, not a reason to download)."""
    if section.files is None or section.dataset is None:
        return section.files, section.val_files, section.val_split
    here = [bool(glob.glob(os.path.expanduser(p), recursive=True)) for p in section.files]
    if any(here) and not all(here):
        missing = section.files[here.index(False)]
        raise RetrofitError(f"data.files: no such file: {missing}{books_hint(missing)}; data.dataset "
                            f"{section.dataset!r} trains only when none of data.files is here")
    return (section.files, section.val_files, None) if all(here) else (None, None, section.val_split)


def check_files(section: DataSection) -> None:
    """The data.files and data.val_files this run reads (sources) exist, are files, are not empty and (text) are
    UTF-8: checked before the model is loaded, so a bad list fails in a second."""
    files, val_files, _ = sources(section)
    for key, paths in (("files", files), ("val_files", val_files)):
        if paths:
            _expand_files(paths, key)


def open_texts(section: DataSection, *, split: str | None = None, files: list[str] | None = None,
               streaming: bool | None = None):
    """The rows of a Hub split or of local files, as a datasets (Iterable)Dataset. Local files are always
    streamed (read once, no cache written); Hub data streams when `section.streaming`."""
    import datasets
    if files is not None:
        paths = _expand_files(files, "files" if files is section.files else "val_files")
        builder = BUILDERS[Path(paths[0]).suffix.lower()]
        extra = {"sample_by": "document"} if builder == "text" else {}  # one .txt file = one document
        return datasets.load_dataset(builder, data_files=paths, split="train", streaming=True,
                                     cache_dir=section.cache_dir, trust_remote_code=False, **extra)
    name = section.dataset
    try:
        return datasets.load_dataset(name, section.config, split=split or section.split,
                                     streaming=section.streaming if streaming is None else streaming,
                                     cache_dir=section.cache_dir, trust_remote_code=False)  # never a script
    except ConnectionError as err:
        local = (f"put its local copy at data.files ({', '.join(section.files)}){books_hint(section.files[0])}"
                 if section.files else "use data.files with local files instead")
        raise RetrofitError(f"cannot reach Hub dataset {name!r} (offline?): {str(err).splitlines()[0][:160]}; "
                            f"{local}") from None
    except Exception as err:  # DatasetNotFoundError, a bad config or split name: datasets' own first line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise RetrofitError(f"could not load Hub dataset {name!r}: {first}") from None


def documents(rows, text_field: str, max_docs: int | None = None):
    """Yield the non-empty texts of `rows`; a missing column is an error naming the columns."""
    for i, row in enumerate(rows):
        if max_docs is not None and i >= max_docs:
            return
        if text_field not in row:
            raise RetrofitError(f"data.text_field {text_field!r} is not a column; columns: {', '.join(row)}")
        text = row[text_field]
        if text:
            yield text


def _tokenize(tokenizer, texts: list[str], eos: int, lengths: list[int] | None = None) -> list[int]:
    """The texts' tokens with EOS after each, back to back; each document's length (EOS included) appended to
    `lengths` when given."""
    out = []
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        out.extend(ids)
        out.append(eos)
        if lengths is not None:
            lengths.append(len(ids) + 1)
    return out


def tokenize_all(texts, tokenizer, eos: int, chunk: int = 256, lengths: list[int] | None = None) -> torch.Tensor:
    """Every text tokenized with EOS after each, concatenated: (N,) int64. With `lengths` (a list), each
    document's token count (EOS included) is appended to it, in order."""
    parts, batch = [], []
    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            parts.append(torch.tensor(_tokenize(tokenizer, batch, eos, lengths), dtype=torch.int64))
            batch = []
    if batch:
        parts.append(torch.tensor(_tokenize(tokenizer, batch, eos, lengths), dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class TokenBlocks:
    """Blocks held in memory; position = blocks consumed; a seeded reshuffle every epoch. A block is (seq_len,)
    token ids, or with data.packing documents (3, seq_len): ids, position ids, labels (data/packing.py)."""

    def __init__(self, blocks: torch.Tensor, shuffle: bool, seed: int):
        self.blocks, self.shuffle, self.seed = blocks, shuffle, seed  # (N, seq_len) or (N, 3, seq_len)
        self.consumed, self._perm = 0, (None, None)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm[0] != epoch:
            n = len(self.blocks)
            perm = (torch.randperm(n, generator=seeded_generator(self.seed, 4, epoch)) if self.shuffle
                    else torch.arange(n))
            self._perm = (epoch, perm)
        return self._perm[1]

    def take(self, n: int) -> torch.Tensor:
        idx = []
        for k in range(self.consumed, self.consumed + n):
            epoch, i = divmod(k, len(self.blocks))
            idx.append(int(self._order(epoch)[i]))
        self.consumed += n
        return self.blocks[idx]

    def peek(self, n: int) -> torch.Tensor:
        return self.blocks[:n]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


class StreamBlocks:
    """Blocks packed on the fly from a streamed dataset. Position = the dataset's own state_dict at a
    document-batch boundary plus the tokens read but not yet emitted. One pass; no shuffling (a streamed
    corpus such as FineWeb-Edu is already mixed, and a shuffle buffer could not be resumed exactly)."""

    def __init__(self, dataset, text_field: str, tokenizer, eos: int, seq_len: int, docs_per_read: int = 64):
        self.dataset, self.text_field, self.tokenizer, self.eos = dataset, text_field, tokenizer, eos
        self.seq_len, self.docs_per_read = seq_len, docs_per_read
        self.buffer: list[int] = []
        self.lengths: list[int] = []  # the documents in buffer, in order (the first one maybe partly taken)
        self.ds_state = None
        self.emitted = 0  # tokens handed out so far
        self._iter = None

    def _read(self) -> bool:
        if self._iter is None:
            if self.ds_state is not None:
                self.dataset.load_state_dict(self.ds_state)
            self._iter = iter(self.dataset)
        texts = []
        try:
            for row in self._iter:
                texts.extend(documents([row], self.text_field))
                if len(texts) == self.docs_per_read:
                    break
        except (ConnectionError, TimeoutError) as err:
            raise RetrofitError(f"lost the connection while streaming the dataset ({type(err).__name__}); "
                                "continue later with `retrofit train RECIPE --resume RUN_DIR`") from None
        if not texts:
            return False
        self.ds_state = self.dataset.state_dict()
        self.buffer.extend(_tokenize(self.tokenizer, texts, self.eos, self.lengths))
        return True

    def ensure(self, tokens: int) -> None:
        while len(self.buffer) < tokens:
            if not self._read():
                raise RetrofitError(f"the streamed data ran out after {self.emitted + len(self.buffer)} tokens "
                                    f"(needed {tokens - len(self.buffer)} more); use more data or fewer steps")

    def take(self, n: int, length: int | None = None) -> torch.Tensor:
        length = length or self.seq_len
        self.ensure(n * length)
        out, self.buffer = self.buffer[: n * length], self.buffer[n * length:]
        self.emitted += n * length
        self._hand_out(n * length)
        return torch.tensor(out, dtype=torch.int64).view(n, length)

    def _hand_out(self, taken: int) -> bool:
        """Drop `taken` tokens from the front of self.lengths; True when that ends inside a document."""
        inside = False
        while taken and self.lengths:
            step = min(taken, self.lengths[0])
            inside = step < self.lengths[0]
            self.lengths[0] -= step
            taken -= step
            if not self.lengths[0]:
                self.lengths.pop(0)
        return inside

    def state_dict(self) -> dict:
        return {"dataset": self.ds_state, "buffer": list(self.buffer), "emitted": self.emitted,
                "lengths": list(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        self.ds_state, self.buffer, self._iter = state["dataset"], list(state["buffer"]), None
        self.emitted, self.lengths = int(state["emitted"]), list(state.get("lengths", []))


class StreamDocuments(StreamBlocks):
    """data.packing documents on a stream: documents are read until they fill `reads_ahead` rows' worth of tokens,
    then packed whole (best fit among them, data/packing.py) into rows handed out in order. take(n) returns rows
    (n, 3, seq_len); take(n, length) cuts concatenated tokens as StreamBlocks does (validation held out from the
    stream's start), and the document it cut into is skipped, so no training token was validated on."""

    def __init__(self, *args, reads_ahead: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads_ahead, self.rows = reads_ahead, []  # rows: packed, not yet handed out; each 3 * seq_len ids
        self.cut = False  # the buffer starts inside a document that a concatenated take cut into

    def take(self, n: int, length: int | None = None) -> torch.Tensor:
        if length is not None:
            return super().take(n, length)
        while len(self.rows) < n:
            self._pack()
        out, self.rows = self.rows[:n], self.rows[n:]
        self.emitted += n * self.seq_len
        return torch.tensor(out, dtype=torch.int64).view(n, 3, self.seq_len)

    def _hand_out(self, taken: int) -> bool:
        self.cut = super()._hand_out(taken)
        return self.cut

    def _pack(self) -> None:
        if self.cut:
            del self.buffer[: self.lengths.pop(0)]
            self.cut = False
        while len(self.buffer) < self.reads_ahead * self.seq_len and self._read():
            pass
        if not self.lengths:
            raise RetrofitError(f"the streamed data ran out after {self.emitted} tokens; use more data or fewer steps")
        packed = pack_documents(torch.tensor(self.buffer, dtype=torch.int64), self.lengths, self.seq_len, self.eos)
        self.rows.extend(packed.view(len(packed), -1).tolist())
        self.buffer, self.lengths = [], []

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rows": [list(r) for r in self.rows], "cut": self.cut}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rows, self.cut = [list(r) for r in state["rows"]], bool(state["cut"])


class LMData:
    task = "lm"

    def __init__(self, train, val: torch.Tensor, seq_len: int):
        self.train, self.val, self.seq_len = train, val, seq_len  # val: (V, eval length)

    def batch(self, step: int, rows: int, length: int) -> dict:
        """`rows` sequences of `length` cut from rows*length/seq_len blocks (staged lengths keep tokens constant)."""
        blocks = self.train.take(rows * length // self.seq_len)  # (n, seq_len), packed documents (n, 3, seq_len)
        if blocks.dim() == 3:
            return packed_batch(blocks, rows, length)
        ids = blocks.reshape(rows, length)
        return {"input_ids": ids, "labels": ids}

    def eval_batches(self, length: int, batches: int, batch_size: int) -> list[dict]:
        if length > self.val.shape[1]:
            raise RetrofitError(f"validation blocks hold {self.val.shape[1]} tokens, fewer than eval length {length}")
        ids = self.val[: batches * batch_size, :length]
        return [{"input_ids": c, "labels": c} for c in ids.split(batch_size)]

    def calibration(self, tokens: int, length: int) -> list[dict]:
        n = max(1, -(-tokens // length))
        source = self.train.peek(n) if isinstance(self.train, TokenBlocks) else self.val[:, :length]
        if source.dim() == 3:  # packed documents: each attends within its own document, as it trains
            rows = packed_batch(source[:n, :, :length], len(source[:n]), length)
            return [{"input_ids": i, "position_ids": p} for i, p in
                    zip(rows["input_ids"].split(8), rows["position_ids"].split(8), strict=True)]
        ids = source[:n, :length]
        return [{"input_ids": c} for c in ids.split(8)]

    def state_dict(self) -> dict:
        return self.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state)


def _eos(tokenizer) -> int:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise RetrofitError("the tokenizer has no EOS (or SEP) token to put between documents; use another tokenizer")
    return int(eos)


def _blocks(tokens: torch.Tensor, length: int) -> torch.Tensor:
    n = len(tokens) // length
    return tokens[: n * length].view(n, length)


def _packed_after(tokens: torch.Tensor, lengths: list[int], held: int, seq_len: int, eos: int) -> torch.Tensor:
    """data.packing documents: the documents after the first `held` tokens (validation), packed whole
    (data/packing.py); the document that validation cut into is skipped, so no training token was validated on."""
    start, first = 0, 0
    while start < held and first < len(lengths):
        start, first = start + lengths[first], first + 1
    rest = lengths[first:]
    if not rest:
        return torch.zeros(0, 3, seq_len, dtype=torch.int64)
    return pack_documents(tokens[start:], rest, seq_len, eos)


def build_lm(section: DataSection, tokenizer, *, seed: int, val_len: int) -> LMData:
    """Packed text blocks of section.seq_len for training, and validation blocks of val_len tokens."""
    if tokenizer is None:
        raise RetrofitError("the lm task needs a tokenizer: set model.tokenizer (a Hub id or folder)")
    eos, seq_len = _eos(tokenizer), section.seq_len
    files, val_files, val_split = sources(section)  # given data.dataset and data.files both: which one trains
    if files is None and section.files:
        print(f"[data] none of data.files is here ({', '.join(section.files)}): training on Hub dataset "
              f"{section.dataset!r}")
    what = ", ".join(files) if files else section.dataset
    rows = open_texts(section, files=files)
    separate_val = val_files is not None or val_split is not None
    if separate_val:  # read only the first val_blocks blocks of it, however large the split is
        val_rows = open_texts(section, files=val_files, split=val_split, streaming=True)
        val_stream, val = StreamBlocks(val_rows, section.text_field, tokenizer, eos, val_len), []
        with contextlib.suppress(RetrofitError):  # fewer blocks than asked for: use what there is
            for _ in range(section.val_blocks):
                val.append(val_stream.take(1))
        if not val:
            raise RetrofitError(f"validation data has fewer than {val_len} tokens; add text or shorten eval.lengths")
        val = torch.cat(val)
    if section.streaming:
        kind = StreamDocuments if section.packing == "documents" else StreamBlocks
        stream = kind(rows, section.text_field, tokenizer, eos, seq_len)
        if not separate_val:
            val = stream.take(section.val_blocks, val_len)
        stream.ensure(seq_len)  # fail now, not at step 1, on an empty stream
        return LMData(stream, val, seq_len)
    lengths: list[int] = []
    tokens = tokenize_all(documents(rows, section.text_field, section.max_docs), tokenizer, eos, lengths=lengths)
    held = 0 if separate_val else section.val_blocks * val_len
    if not separate_val:
        val = _blocks(tokens[:held], val_len)
    if section.packing == "documents":
        train = _packed_after(tokens, lengths, held, seq_len, eos)
    else:
        train = _blocks(tokens[held:], seq_len)
    if len(train) == 0:
        raise RetrofitError(f"data {what} gave {len(tokens)} tokens: not enough for {section.val_blocks} validation "
                            f"blocks of {val_len} and one training block of {seq_len}; add text or lower "
                            "data.seq_len / data.val_blocks")
    return LMData(TokenBlocks(train, section.shuffle, seed), val, seq_len)
