"""The one exception type a user can hit: its message is a single line saying what was wrong and what to do.

The CLI prints it without a traceback and exits with code 2 (bad input).
"""

import difflib


class RetrofitError(ValueError):
    """Bad input: an unknown norm, an impossible option, a model we cannot patch, a missing file."""


def closest(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close: the tail of a one-line error."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
