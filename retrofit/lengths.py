"""Context lengths as users write them on a command line: one parser for every command.

    parse_lengths("256,512,1024")          # [256, 512, 1024]
    parse_lengths("256,512,...,65536")     # doubling (any ratio b/a) up to the last: [256, 512, ..., 65536]
    parse_lengths("100,200,...,500")       # evenly spaced when the last lies on a, b, b+(b-a), ...
"""

from __future__ import annotations

from .bounds import MOST, check_size
from .errors import RetrofitError, quoted


def parse_lengths(text: str) -> list[int]:
    """Sorted, distinct lengths >= 2 from a comma list, where `a,b,...,z` continues the ratio b/a up to z
    when z lies on it (geometric), else the step b-a (arithmetic); anything else is a one-line error."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = RetrofitError(f"--lengths {text!r}: write a comma list like 256,512,1024, a doubling like "
                        "256,512,...,65536 or a range like 100,200,...,500 (the last length must lie on it)")
    span = None
    try:
        if "..." not in parts:
            lengths = [int(p) for p in parts]
        else:
            i = parts.index("...")
            if i < 2 or i != len(parts) - 2:
                raise bad
            head = [int(p) for p in parts[: i - 2]]
            a, b, end = int(parts[i - 2]), int(parts[i - 1]), int(parts[-1])
            if a < 1 or b <= a or end < b:
                raise bad
            ratio = b // a if b % a == 0 else 0
            geometric = [a * ratio ** k for k in range(64) if a * ratio ** k <= end] if ratio >= 2 else []
            if geometric and geometric[-1] == end:
                lengths = head + geometric
            elif (end - a) % (b - a) == 0:
                span = range(a, end + 1, b - a)  # a range, not a list: counted before it is built
            else:
                raise bad
    except ValueError:
        raise bad from None
    if span is not None:  # 2,3,...,100000000 would be 100 million lengths
        check_size(len(head) + len(span), f"--lengths {quoted(text, 40)}: the number of lengths", MOST["lengths"])
        lengths = head + list(span)
    check_size(len(lengths), f"--lengths {quoted(text, 40)}: the number of lengths", MOST["lengths"], least=0)
    if not lengths or min(lengths) < 2:
        raise RetrofitError(f"--lengths {text!r}: give at least one length, each an integer >= 2")
    return sorted(set(lengths))
