"""Write files and folders all at once, delete only what we made, and lock a folder to one writer.

    with atomic_folder("gpt2-avnorm", what="--out") as tmp:
        model.save_pretrained(tmp)
    atomic_write_text("run/result.json", text)          # readers see the old file or the new one
    tmp = owned_folder(run_dir / ".tmp-final")           # a folder with our marker in it ...
    remove_owned(tmp, inside=run_dir)                    # ... which is the only kind we ever rmtree
    with folder_lock(run_dir):                           # one writer per run folder (fcntl.flock)
        ...

A crash or an error inside the block leaves nothing behind: no half-written model to load silently.
Files come out with the mode the umask gives (not mkstemp's 0600) and are fsynced, with their folder,
around the rename, so a power cut cannot leave an empty file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import RetrofitError

# Written into every folder retrofit creates and may later delete: rmtree needs it (see remove_owned).
MARKER = ".retrofit-owned"
LOCK = ".lock"


def _umask() -> int:
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


def owned_folder(path) -> Path:
    """Create `path` (absent or empty) holding the marker that lets remove_owned delete it later."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("created by retrofit; safe for retrofit to delete\n")
    return path


def owns(path, inside) -> bool:
    """True when `path` is a real folder strictly inside `inside` that holds our marker."""
    path, inside = Path(path), Path(inside)
    if path.is_symlink() or not path.is_dir() or not (path / MARKER).is_file():
        return False
    resolved, root = path.resolve(), inside.resolve()
    return resolved != root and root in resolved.parents


def remove_owned(path, inside) -> bool:
    """rmtree `path` only if it can be proven ours (see owns); returns whether it was removed."""
    if not owns(path, inside):
        return False
    shutil.rmtree(path)
    return True


@contextlib.contextmanager
def atomic_folder(out, what: str = "folder"):
    """Yields a temporary Path; on success it becomes `out` (which must be absent or empty)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise RetrofitError(f"{what} {out} exists and is not empty; choose another or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    owned_folder(tmp)
    try:
        yield tmp
        (tmp / MARKER).unlink()
        for p in sorted(tmp.rglob("*")):
            if p.is_file() and not p.is_symlink():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        if tmp.exists():
            (tmp / MARKER).touch()  # it is ours either way: made by mkdtemp above
            remove_owned(tmp, out.parent)
        raise


def atomic_write_text(path, text: str) -> Path:
    """Write a file through a temporary sibling and a rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a result file is as readable as any other
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def folder_lock(folder, enabled: bool = True):
    """Hold an exclusive fcntl.flock on FOLDER/.lock (which holds our pid) for the block; a second holder
    gets a one-line error naming the first's pid. The kernel drops the lock if the process dies."""
    if not enabled:
        yield None
        return
    import fcntl
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    f = open(path, "a+")  # noqa: SIM115 -- held open across the yield: closing it releases the lock
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RetrofitError(f"{folder} is in use by process {holder} (lock {path}); wait for it to finish "
                                "or stop it before resuming") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield path
    finally:
        f.close()  # closing the file releases the flock
