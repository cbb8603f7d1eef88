"""What retrofit shows of a value someone else wrote (a path, a model's name in a results file, a recipe's name):
one line, nothing in it read as markup. Every message, report and card that echoes such a value passes one of these.

    one_line("runs/a\\nb")          # 'runs/a\\\\nb': a control character is shown escaped (retrofit.errors)
    md_text("<img src=x> # h")     # markdown prose: HTML escaped, markdown's active characters escaped
    md_inline("a | b")              # mid-line or in a table cell: HTML and `|` escaped (code-built **bold** kept)
    md_code("x`y")                  # an inline code span no backtick inside can close
    md_fence(text, "yaml")          # a code block no backtick run inside can close

A newline in a path would make a one-line error two lines; a model name holding `<img>` or `# ` would render as an
image or a heading in results.md. Escaping where the value is shown (not where it is read) keeps the value itself
intact in JSON, where it is data.
"""

from __future__ import annotations

import html
import re

from ..errors import one_line


def _flat(value) -> str:
    """Whitespace runs (newlines included) as one space, other control characters escaped: one line of text."""
    return one_line(" ".join(str(value).split()))


def md_text(value) -> str:
    """`value` as markdown text on one line: HTML escaped (no tag renders), markdown's active characters escaped."""
    return re.sub(r"([\\`*_{}\[\]()#+!|~>])", r"\\\1", html.escape(_flat(value), quote=False))


def md_inline(value) -> str:
    """`value` mid-line in markdown or as a table cell: one line, HTML escaped, `|` escaped (it would end a cell).
    Markup the code builds (`**64** (train)`) stays markup: only what makes a line, a cell or HTML is escaped."""
    return html.escape(_flat(value), quote=False).replace("|", "\\|")


def md_code(value) -> str:
    """`value` as an inline code span on one line (HTML is literal there), safe in a table cell."""
    text = _flat(value).replace("|", "\\|")
    fence = "`" * (max(map(len, re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fence(text: str, language: str) -> list[str]:
    """`text` as a fenced code block that nothing inside can close (the fence outgrows every backtick run)."""
    fence = "`" * max(3, max(map(len, re.findall(r"`+", text)), default=0) + 1)
    return [fence + language, text.rstrip(), fence]


__all__ = ["md_code", "md_fence", "md_inline", "md_text", "one_line"]
