"""Write files and folders all at once, delete only what we made, and lock a folder to one writer.

    with atomic_folder("gpt2-avnorm", what="--out") as tmp:
        model.save_pretrained(tmp)
    atomic_write_text("run/result.json", text)          # readers see the old file or the new one
    tmp = owned_folder(run_dir / ".tmp-final")           # a folder with our marker in it ...
    remove_owned(tmp, inside=run_dir)                    # ... which is the only kind we ever rmtree
    with folder_lock(run_dir):                           # one writer per run folder (fcntl.flock)
        ...
    out = check_output("~/runs/x", "--out")              # the one rule for a folder a verb writes (below)
    adopt("runs/old")                                    # a folder from before the marker, because its user says so
    with output_folder(out, "--out") as out:             # ... made, marked and locked for the block
        ...

The rule for every folder a verb writes (train, experiment, patch, eval, diagnose, push --dry-run): it is new,
empty, or one retrofit made (it holds MARKER; nothing else counts, however retrofit-like its files look; a run
from before the marker comes in by `retrofit adopt DIR`). A folder of the user's own files, `/` or the home
folder is refused in one line before anything is touched. `~` is expanded once, by check_output, and the path it
returns is the one every check, writer and printed hint uses.

A crash or an error inside the block leaves nothing behind: no half-written model to load silently.
Files come out with the mode the umask gives (not mkstemp's 0600) and are fsynced, with their folder,
around the rename, so a power cut cannot leave an empty file under the final name.

Nothing written inside a folder retrofit owns leaves it through a symbolic link (a downloaded run folder may hold
one: eval/ -> the user's results): a folder a verb writes into holds no link (check_output), the marker and the
lock are opened without following one (O_NOFOLLOW, the marker created exclusively), and atomic_writer opens every
folder below the owned root without following one, so a link swapped in later is refused too.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from ..errors import RetrofitError
from .fs import fsync_dir, umask

# Written into every folder retrofit creates and may later delete: rmtree needs it (see remove_owned).
MARKER = ".retrofit-owned"
LOCK = ".lock"


def owned_folder(path) -> Path:
    """Create `path` (absent or empty) holding the marker that lets remove_owned delete it later."""
    path = Path(path)
    if path.is_symlink():
        raise _link_error(path)
    path.mkdir(parents=True, exist_ok=True)
    write_marker(path, "created by retrofit; safe for retrofit to delete\n")
    return path


def refuse_link(path) -> Path:
    """`path`, refused in one line when it is a symbolic link (even one pointing nowhere): a file retrofit writes
    beside another tool's files (an axolotl run's output_dir) is replaced by atomic_writer, never written through,
    but the user's link is left as it was."""
    path = Path(path)
    if path.is_symlink():
        raise _link_error(path)
    return path


def _link_error(path: Path) -> RetrofitError:
    return RetrofitError(f"{path} is a symbolic link; retrofit never writes through a link inside a folder it writes "
                         "(move the link away, or give another folder)")


def write_marker(folder: Path, text: str) -> None:
    """MARKER in `folder`, created exclusively and never through a link: an existing marker file is kept; a link in
    its place (even one pointing nowhere) is refused, its target untouched."""
    try:
        fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        if not _made_by_retrofit(folder):
            raise _link_error(folder / MARKER) from None
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


def check_no_links(folder: Path, what: str, most: int = 200_000) -> None:
    """No symbolic link anywhere inside `folder` (a folder retrofit is about to write into), looked at without
    following any: the first one found is a one-line RetrofitError naming it. `most` entries at most are looked at
    (a run folder holds some hundred)."""
    seen = 0
    for top, folders, files in os.walk(folder):  # os.walk never descends into a linked folder; it lists it
        for name in folders + files:
            seen += 1
            if os.path.islink(os.path.join(top, name)):
                raise RetrofitError(f"{what} {folder}: {_link_error(Path(top) / name)}")
        if seen > most:
            return


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


# ---- output folders: the one rule --------------------------------------------------------------------------------

def output_path(path) -> Path:
    """`~` expanded: what the user typed, as every check and writer must see it (never a literal `./~`)."""
    return Path(os.path.expanduser(str(path)))


def _made_by_retrofit(folder: Path) -> bool:
    """Holds MARKER (a real file). Nothing else makes a folder retrofit's: a results.json or log.jsonl that looks
    like retrofit's may be a copy among the user's own files. An older run, written before the marker existed,
    comes in only when its user says so: `retrofit adopt DIR` (adopt, below)."""
    marker = folder / MARKER
    return marker.is_file() and not marker.is_symlink()


def adopt(path) -> tuple[Path, list[tuple[str, int]]]:
    """Mark the folder at `path` as retrofit's, because its user says it is (a run from before the marker
    existed): retrofit may then write into it and delete what it made there. Returns (folder, [(name, bytes)]
    of what was in it). Refused in one line: a link, a file, a missing folder, /, the home folder, one already
    marked."""
    out = output_path(path)
    if out.is_symlink() or not out.is_dir():
        raise RetrofitError(f"{out} is " + ("a symbolic link" if out.is_symlink() else "not a folder" if out.exists()
                                           else "missing") + "; adopt takes a folder retrofit wrote")
    if out.resolve() in (Path("/"), Path.home().resolve()):
        raise RetrofitError(f"{out} is / or the home folder: retrofit never adopts it")
    if (out / MARKER).is_symlink():
        raise _link_error(out / MARKER)
    if _made_by_retrofit(out):
        raise RetrofitError(f"{out} is retrofit's already (it has {MARKER}); nothing to adopt")
    listing = []
    for p in sorted(out.iterdir())[:1000]:
        listing.append((p.name + ("/" if p.is_dir() and not p.is_symlink() else ""),
                        p.lstat().st_size if not p.is_dir() else 0))
    with folder_lock(out):  # a verb that rewrites a folder holds its lock
        write_marker(out, "adopted by its user (retrofit adopt): retrofit writes here (and deletes only what it "
                          "made)\n")
    return out, listing


def check_output(path, what: str = "--out", *, empty: bool = False) -> Path:
    """The rule for a folder a verb writes: new, empty, or made by retrofit (with empty=True, for a folder that
    atomic_folder replaces whole: new or empty). Anything else, a symbolic link or a file is a one-line
    RetrofitError, before anything is touched. Returns the path with `~` expanded."""
    out = output_path(path)
    if out.is_symlink():
        raise RetrofitError(f"{what} {out} is a symbolic link; give the real folder (retrofit never writes "
                            "through a link it did not make)")
    if out.exists() and not out.is_dir():
        raise RetrofitError(f"{what} {out} is a file, not a folder; choose another {what} or remove it")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if empty:
        raise RetrofitError(f"{what} {out} exists and is not empty; choose another {what} or remove it")
    if not _made_by_retrofit(out):
        raise RetrofitError(f"{what} {out} holds files retrofit did not write (it has no {MARKER}); choose a new "
                            "or empty folder: retrofit never writes into a folder of yours (a run from an older "
                            f"retrofit: `retrofit adopt {out}` first)")
    check_no_links(out, what)  # a copied or downloaded run may hold eval/ -> the user's folder
    return out


def make_output(path, what: str = "--out") -> Path:
    """check_output, then create the folder (and its parents) and mark it as retrofit's; returns its path."""
    out = check_output(path, what)
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "made by retrofit: retrofit writes here (and deletes only what it made)\n")
    return out


@contextlib.contextmanager
def output_folder(path, what: str = "--out", *, enabled: bool = True):
    """make_output and folder_lock for the block (a second writer gets a one-line error). When the block fails
    and the folder was new or empty and holds nothing but the marker and the lock, it is put back as it was (the
    folder and the parents this call made removed): a refused run leaves nothing behind. enabled=False
    (accelerate's other processes): the check only."""
    out = check_output(path, what)
    if not enabled:
        yield out
        return
    made = [p for p in (out, *out.parents) if not p.exists()]
    was_empty = bool(made) or not any(out.iterdir())
    make_output(out, what)
    with folder_lock(out):
        try:
            yield out
        except BaseException:
            if was_empty and {p.name for p in out.iterdir()} <= {MARKER, LOCK}:
                _remove_bare(out, made)
            raise


def _remove_bare(out: Path, made: list[Path]) -> None:
    """Remove our marker and lock from `out`, then the folders in `made` (out and the parents this run made)
    while they are empty: rmdir, never rmtree."""
    with contextlib.suppress(OSError):
        for name in (MARKER, LOCK):
            (out / name).unlink(missing_ok=True)
        for folder in made:
            folder.rmdir()  # stops at the first that is not empty (OSError): someone else's now


# ---- a folder written all at once -------------------------------------------------------------------------------

def clean_abandoned(out) -> list[Path]:
    """Remove the `.NAME.*` siblings of `out` that a killed atomic_folder left: ours (MARKER in them) and with
    their lock free (the kernel drops a flock when its process dies, so a live save keeps its folder)."""
    import fcntl
    out, removed = Path(out), []
    for tmp in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        lock = tmp / LOCK
        if not owns(tmp, out.parent) or lock.is_symlink() or not lock.is_file():
            continue
        with open(lock, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a save in progress
            shutil.rmtree(tmp)
            removed.append(tmp)
    return removed


@contextlib.contextmanager
def atomic_folder(out, what: str = "folder"):
    """Yields a temporary Path; on success it becomes `out` (new or empty: check_output(empty=True)).
    The temporary sibling `.NAME.XXXX` holds MARKER and a held lock from its first moment until the rename, so
    one left by a kill (SIGKILL mid-save) is provably ours and abandoned: the next atomic_folder for the same
    `out` removes it (clean_abandoned)."""
    out = check_output(out, what, empty=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_abandoned(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700
    try:
        with folder_lock(tmp):  # before the marker: a marked folder without a held lock is abandoned
            owned_folder(tmp)
            yield tmp
            for p in sorted(tmp.rglob("*")):
                if p.is_file() and not p.is_symlink() and p.name not in (MARKER, LOCK):
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
            for name in (MARKER, LOCK):  # still locked: the lock is on the open file, wherever it now is
                (out / name).unlink()
            fsync_dir(out.parent)
    except BaseException:
        if tmp.exists():
            (tmp / MARKER).touch()  # it is ours either way: made by mkdtemp above
            remove_owned(tmp, out.parent)
        raise


def atomic_write_text(path, text: str) -> Path:
    """Write a file through a temporary sibling and a rename: readers see the old file or the new one."""
    with atomic_writer(path) as f:
        f.write(text)
    return Path(path)


@contextlib.contextmanager
def atomic_writer(path, binary: bool = False):
    """A file open for writing in pieces (a large file never held whole; binary=True for a figure:
    fig.savefig(f, format="png")), renamed to `path` when the block ends without an error; otherwise removed.
    Readers see the old file or the new one. Below a folder retrofit owns, no link is followed (_folder_fd)."""
    path = Path(os.path.abspath(path))
    with _folder_fd(path.parent) as folder:
        tmp = f".{path.name}.{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o666, dir_fd=folder)  # 0o666 less the umask: as readable as any other file
        try:
            with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)  # the final name: replaced, not followed
            os.fsync(folder)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise


def _owned_root(folder: Path) -> Path | None:
    """The nearest folder at or above `folder` that is retrofit's: a real folder (not a link) holding MARKER."""
    for candidate in (folder, *folder.parents):
        try:
            if stat.S_ISDIR(os.lstat(candidate).st_mode) and _made_by_retrofit(candidate):
                return candidate
        except OSError:
            continue  # not made yet
    return None


@contextlib.contextmanager
def _folder_fd(folder: Path):
    """An open descriptor of `folder`, made where missing. Below the owned root it is in, each folder is made and
    opened by name relative to the one above it, never following a link (O_NOFOLLOW): what was checked is what is
    written into. Outside any owned folder (a benchmark's --out file): the folder as given."""
    root = _owned_root(folder)
    if root is None:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for i, part in enumerate(folder.relative_to(root).parts):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_error(root.joinpath(*folder.relative_to(root).parts[: i + 1])) from None
                raise
            os.close(fd)
            fd = below
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_lock(folder, enabled: bool = True):
    """Hold an exclusive fcntl.flock on FOLDER/.lock (which holds our pid) for the block; a second holder
    gets a one-line error naming the first's pid. The kernel drops the lock if the process dies. The file is
    removed when the block ends (a finished run keeps no .lock); whoever opened it just before holds a lock on a
    file no longer at the path, which is checked and refused like a held lock."""
    if not enabled:
        yield None
        return
    import fcntl
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    try:  # never through a link: it would truncate the file it points at and write a pid into it
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise
    f = os.fdopen(fd, "r+")  # held open across the yield: closing it releases the lock
    held = False
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = _same_file(f, path)
        except BlockingIOError:
            pass
        if not held:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RetrofitError(f"{folder} is in use by process {holder} (lock {path}); wait for it to finish, "
                                "or stop it, and try again") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield path
    finally:
        if held and _same_file(f, path):  # removed while still held: nobody can lock it in between
            with contextlib.suppress(OSError):
                path.unlink()
        f.close()  # closing the file releases the flock


def _same_file(f, path: Path) -> bool:
    """Whether the open file `f` is the one at `path` (not one removed, or replaced, since it was opened)."""
    try:
        mine, there = os.fstat(f.fileno()), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
