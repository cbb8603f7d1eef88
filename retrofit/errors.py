"""The one exception type a user can hit: its message is a single line saying what was wrong and what to do.

The CLI prints it without a traceback and exits with code 2 (bad input); one_line escapes what would break the line.
Text files are read here too
(read_utf8, check_utf8): one rule for every verb, UTF-8 or an error naming the file and the first bad byte.
"""

import codecs
import difflib
import errno
import os
import re
import reprlib
import unicodedata
from pathlib import Path

# Unicode's line and paragraph separators and the bidirectional overrides (which reorder what a terminal shows)
# count as control characters here, beside the C0/C1 controls (category Cc).
_BIDI = {"\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"}
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _BIDI


def one_line(value) -> str:
    """str(value) with every control character written as an escape (\\n, \\x1b, \\u2028): one line, and a
    terminal shows it as it is. Idempotent: an escape holds no control character."""
    text = str(value)
    if not any(map(_is_control, text)):
        return text
    return "".join(_NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
                   if _is_control(ch) else ch for ch in text)


class RetrofitError(ValueError):
    """Bad input: an unknown norm, an impossible option, a model we cannot patch, a missing file.

    Its message is one line whatever it echoes: a control character in a value it quotes (a newline in a path) is
    shown escaped (one_line)."""

    def __init__(self, message="", *args):
        super().__init__(one_line(message), *args)


def closest(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close: the tail of a one-line error."""
    if not isinstance(word, (str, int, float)) or len(str(word)) > 100:  # a list, a pasted paragraph: no guess
        return ""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


# Bounded repr: a value echoed in a one-line error is cut, never the repr of whatever the user wrote (a recipe
# may hold a list of a million items). reprlib stops early, so the cost is bounded too, not only the length.
def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 3, 8, 8, 6, 6
    short.maxstring, short.maxother, short.maxlong = 60, 60, 40
    return short


_SHORT = _short_repr()  # configured once at import, never changed


def quoted(value, limit: int = 80) -> str:
    """repr(value) cut to at most `limit` characters (with '...'): how an error message echoes a user's value."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- a write that failed for want of room: one rule for every writer ------------------------------------------------

# errno -> what the write ran into
WRITE_LIMITS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EFBIG: "a file reached the size limit (File too large: `ulimit -f`, or the largest file the file "
                             "system takes)"}
# What writers say without an errno: torch's zip writer ("PytorchStreamWriter failed writing file data/0: file write
# failed", then "unexpected pos 141824 vs 141716" when it checks its position after a short write), safetensors'
# serializer ("Error while serializing: I/O error: File too large (os error 27)").
_WRITER = re.compile(r"PytorchStreamWriter failed writing|file write failed|unexpected pos \d+ vs \d+", re.I)
_OS_ERROR = re.compile(r"serializ.*\(os error (\d+)\)", re.I | re.S)


def write_failure(err: BaseException) -> str | None:
    """What a failed write ran into ('the disk is full', 'a file reached the size limit ...'), read from the error or
    any it was raised while handling; None when `err` is not a write that failed for want of room."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in WRITE_LIMITS:
            return WRITE_LIMITS[err.errno]
        text = str(err)
        found = _OS_ERROR.search(text)
        if found and int(found.group(1)) in WRITE_LIMITS:
            return WRITE_LIMITS[int(found.group(1))]
        if "No space left on device" in text:
            return WRITE_LIMITS[errno.ENOSPC]
        if isinstance(err, RuntimeError) and _WRITER.search(text):
            return "the disk is full or a file reached the size limit"
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def check_token_ids(largest: int, rows: int, tokens: str, model: str) -> None:
    """Token ids index the model's embedding: an id >= its rows is an IndexError deep inside a forward. Checked
    where tokens meet a model (train's setup, eval), naming both sides."""
    if largest >= rows:
        raise RetrofitError(f"{tokens} has token ids up to {largest:,} but {model} has {rows:,} embedding rows "
                            "(vocab_size): they do not belong together; use the model's own tokenizer, or a model "
                            "whose vocabulary holds every id")


# ---- the one text-reading rule: UTF-8 or a one-line error naming the file and the first bad byte ------------------

def _not_utf8(label: str, err: UnicodeDecodeError, offset: int) -> RetrofitError:
    return RetrofitError(f"{label} is not UTF-8 text (byte {offset + err.start:,} is {err.object[err.start]:#04x}); "
                         f"convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8")


def books_hint(path) -> str:
    """What to add to 'no such file' for a path in a `books/` folder: the recipes read data/books/*.txt, which
    retrofit does not ship (docs/training.md, "The books", says what they are and where to get them)."""
    folders = Path(os.path.expanduser(str(path))).parts[:-1]
    return ("; the recipes' books (Austen's six novels, Moby-Dick) are not shipped: docs/training.md, 'The books', "
            "says where to get them" if "books" in folders else "")


def check_regular(path, label: str) -> None:
    """Only a regular file is read as data: a device (/dev/urandom), a FIFO or a socket never ends or blocks, and
    is not 'no such file' either."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists() and not p.is_file() and not p.is_dir():
        kind = "a FIFO (named pipe)" if p.is_fifo() else "a device" if p.is_char_device() or p.is_block_device() \
            else "a socket" if p.is_socket() else "not a regular file"
        raise RetrofitError(f"{label} is {kind}, not a regular file; save the text to a file and give that")


def _checked_path(path, what: str) -> tuple[Path, str]:
    label = f"{what} {path}".strip()
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise RetrofitError(f"{label} is a folder; give a text file")
    check_regular(p, label)
    if not p.is_file():
        raise RetrofitError(f"{label}: no such file{books_hint(path)}")
    return p, label


def read_utf8(path, what: str = "", most: int | None = None) -> str:
    """The text of a file, which must be UTF-8 (every verb reads text this way: train, eval, patch, diagnose).

    `what` names the flag or key in the error ("--calibration-text", "data.files"); a file over `most` bytes is
    refused before it is read (a settings file is small; text a model reads goes through retrofit.data.read)."""
    p, label = _checked_path(path, what)
    if most is not None and p.stat().st_size > most:
        raise RetrofitError(f"{label} is {p.stat().st_size:,} bytes, more than the {most:,} such a file may have")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise RetrofitError(f"cannot read {label}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(label, err, 0) from None


def check_utf8(path, what: str = "", chunk: int = 1 << 20) -> None:
    """read_utf8's checks without holding the file in memory (training corpora can be large)."""
    for _ in iter_utf8(path, what, chunk):
        pass


def iter_utf8(path, what: str = "", chunk: int = 1 << 20):
    """The text of a file in pieces of about `chunk` bytes, each ending at a whitespace where one is near (so a
    word is never cut in two): read_utf8's rule, with memory bounded by `chunk` however large the file is.
    The caller stops iterating when it has what it needs (stream_tokens): the rest is never read."""
    p, label = _checked_path(path, what)
    decoder, offset, carry = codecs.getincrementaldecoder("utf-8")(), 0, ""
    try:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                try:
                    text = carry + decoder.decode(block)
                except UnicodeDecodeError as err:
                    raise _not_utf8(label, err, offset) from None
                offset += len(block)
                cut = max(text.rfind(" "), text.rfind("\n"))  # the space starts the next piece: " word"
                cut = cut if cut > len(text) // 2 else len(text)
                carry = text[cut:]
                if cut:
                    yield text[:cut]
            try:
                text = carry + decoder.decode(b"", final=True)
            except UnicodeDecodeError as err:
                raise _not_utf8(label, err, offset) from None
            if text:
                yield text
    except OSError as err:
        raise RetrofitError(f"cannot read {label}: {err.strerror or err}") from None
