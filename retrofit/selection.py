"""Which layers (and heads) a selective patch touches: `retrofit.patch(model, norm, layers=..., heads=...)`.

    parse_selection("16-29", 30, "layers")        # [16, ..., 29]: a range, both ends included
    parse_selection("0-29:4", 30, "layers")       # [0, 4, ..., 28]: every 4th of a range
    parse_selection(":4", 30, "layers")           # every 4th from 0 to the last (same as 0-29:4 here)
    parse_selection("16-", 30, "layers")          # 16 to the last
    parse_selection("0,3", 9, "heads")            # indices; '+' separates items too: "0+3", "0-3+8"
    parse_selection([16, 17, 18], 30, "layers")   # a list of ints, as PEFT's layers_to_transform

One syntax for every place a selection is written: items separated by ',' or '+' ('+' is for specs that already
split on commas, e.g. eval's `--patch avnorm:layers=16-29+3,heads=0+3`), each item N, A-B, A-, A-B:S or :S
(0-based, ends included). Indices are layers in model order (the attention modules `retrofit.patch` finds) and
query heads within a layer. The result is sorted, without repeats, and never empty; it is what `config.retrofit`
records, so a reload reproduces it exactly (record.describe_selection writes it back in this syntax).
"""

from __future__ import annotations

import re

from .errors import RetrofitError, quoted

_ITEM = re.compile(r"^(?:(\d+)|(\d+)-(\d*)|(\d+)-(\d+):(\d+)|:(\d+))$")
SYNTAX = "N, A-B, A-, A-B:STEP or :STEP, joined by ',' or '+', e.g. 16-29 or 0,3 or :4"
MAX_DIGITS = 100  # as retrofit.io.readers bounds a file's numbers


def _items(spec) -> list:
    """The items of a selection: a list of ints / strings, or one string split on ',' and '+'."""
    if isinstance(spec, bool):
        return [spec]  # refused by _expand
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, str):
        return [s.strip() for s in re.split(r"[,+]", spec)]
    if isinstance(spec, (list, tuple)):
        return [s.strip() if isinstance(s, str) else s for s in spec]
    return [spec]


def _expand(item, count: int | None, what: str) -> range | list[int]:
    """One item as indices; count None (the syntax only): open ends stop at their start, nothing is expanded."""
    if isinstance(item, int) and not isinstance(item, bool):
        return [item]
    longest = max(map(len, re.findall(r"\d+", item)), default=0) if isinstance(item, str) else 0
    if longest > MAX_DIGITS:  # bounded before int(): 4,301 digits raise inside it (0-99999999999 is fine: never listed)
        raise RetrofitError(f"{what}: {quoted(item, 40)} holds a number of {longest:,} digits; a selection's numbers "
                            f"have at most {MAX_DIGITS}")
    match = _ITEM.match(item) if isinstance(item, str) else None
    if match is None:
        raise RetrofitError(f"{what}: cannot read {item!r}; write {SYNTAX}")
    one, start, end, s_start, s_end, s_step, every = match.groups()
    if one is not None:
        return [int(one)]
    if every is not None:
        start, end, step = 0, (count - 1 if count is not None else 0), int(every)
    elif s_step is not None:
        start, end, step = int(s_start), int(s_end), int(s_step)
    else:
        start = int(start)  # an open end: the last index (an A past it is then out of range, not an empty range)
        end, step = (int(end) if end else max(start, count - 1) if count is not None else start), 1
    if step < 1 or end < start:
        raise RetrofitError(f"{what}: {item!r} is an empty range (write A-B with A <= B, a step >= 1)")
    return range(start, end + 1, step)


def parse_selection(spec, count: int | None, what: str) -> list[int]:
    """`spec` (see the module doc) -> sorted distinct indices in [0, count). None means every index.
    Refuses a malformed item, an index out of range and an empty selection, each in one line naming `what`.
    count None checks the syntax only (before the model is loaded): open ends stop at their start."""
    if spec is None:
        return list(range(count or 0))
    chosen: set[int] = set()
    for item in _items(spec):
        if item == "":
            continue
        indices = _expand(item, count, what)
        if indices[0] < 0:  # only a list's int can be negative (the string syntax has no minus sign)
            raise RetrofitError(f"{what}: index {indices[0]} is out of range; indices start at 0")
        if count is not None and indices[-1] >= count:  # arithmetic on the range: "0-99999999" is never listed
            k = max(0, -(-(count - indices[0]) // indices.step)) if isinstance(indices, range) else 0
            noun = re.findall(r"[a-z]+", what)[-1]  # "--layers", "patch.layers" -> "layers"
            raise RetrofitError(f"{what}: index {indices[k]} is out of range; this model has {count} {noun} "
                                f"(0-{count - 1})")
        chosen.update(indices if count is not None else indices[:1])  # the syntax only: never a huge range
    if not chosen:
        raise RetrofitError(f"{what}: the selection {spec!r} is empty; select at least one: {SYNTAX}")
    return sorted(chosen)


def select(items: list, layers, heads, head_count: int):
    """(the selected items — attention modules in model order —, the layer indices or None = all, the head indices
    or None = all). The rules between fields (nope, per-head norms) are the PatchSpec's; this checks the range."""
    chosen = parse_selection(layers, len(items), "layers") if layers is not None else None
    picked = parse_selection(heads, head_count, "heads") if heads is not None else None
    return (items if chosen is None else [items[i] for i in chosen]), chosen, picked


__all__ = ["SYNTAX", "parse_selection", "select"]
