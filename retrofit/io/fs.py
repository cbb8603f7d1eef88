"""File-system facts the writers need (atomic.py, load/save.py, train/resume_state.py): the process's umask, read
without changing it, and the fsync of a folder or a whole tree (so a rename inside it survives a power cut)."""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    try:  # read, not set: os.umask(x) would change it for every thread for a moment
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file under `path`, then `path` itself: what a rename of it (or of its files) is about to publish."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)
