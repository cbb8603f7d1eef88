"""The one exception type a user can hit: its message is a single line saying what was wrong and what to do.

The CLI prints it without a traceback and exits with code 2 (bad input).
"""


class RetrofitError(ValueError):
    """Bad input: an unknown norm, an impossible option, a model we cannot patch, a missing file."""
