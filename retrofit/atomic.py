"""Write a folder all at once: into a temporary sibling, renamed into place only when complete.

    with atomic_folder("gpt2-avnorm", what="--out") as tmp:
        model.save_pretrained(tmp)

A crash or an error inside the block leaves nothing behind: no half-written model to load silently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import RetrofitError


@contextlib.contextmanager
def atomic_folder(out, what: str = "folder"):
    """Yields a temporary Path; on success it becomes `out` (which must be absent or empty)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise RetrofitError(f"{what} {out} exists and is not empty; choose another or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path, text: str) -> Path:
    """Write a file through a temporary sibling and a rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
