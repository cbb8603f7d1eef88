"""Resumable checkpoints, written atomically.

    run/checkpoints/step-0000100/   model, optimizer, RNG of every process (accelerate's save_state),
                                    meta.json: step, data position, the recipe it was trained with

                                    manifest.json: size and sha256 of every file above (written last)

A checkpoint is written into `.tmp-step-...` (created with retrofit's ownership marker), its files
fsynced, `meta.json` then `manifest.json` written last, and only then renamed to `step-...`. A rename
is atomic, so a kill at any moment leaves either the complete checkpoint or a `.tmp-` folder that
nothing ever loads (and the next save deletes). Resume takes the newest `step-*` folder whose files
match its manifest (a damaged one is named in one line and the one before it is used) and refuses one
trained with a different recipe. Only folders holding the marker are ever deleted.

Resume state is data, never code. The manifest catches damage, not intent: whoever crafts a run folder signs it
again. So every pickled file accelerate wrote (optimizer.bin, random_states_N.pkl, ...) is read first by
torch's weights-only unpickler with an allow-list (numpy's arrays for the RNG states) and its contents checked,
and the RNG states are set by retrofit; the shards of train.fsdp go through fsdp.shard_reader. A file that cannot be
read that way is a one-line refusal naming it: never code run, never a silent fresh start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
from pathlib import Path

from ..errors import RetrofitError, write_failure
from ..io.atomic import MARKER, atomic_write_text, owned_folder, remove_owned
from ..io.fs import fsync_tree
from ..io.readers import expect, read_json
from . import fsdp, zero

FOLDER, PREFIX, TMP, MANIFEST = "checkpoints", "step-", ".tmp-", "manifest.json"

# Keys that may differ between the run and its resumption without changing the result.
_IGNORED = ("name", "output.", "train.progress", "train.log_every", "train.cpu_release_memory", "eval.")
EXTENDABLE = "train.steps"  # raised on resume: the run goes on from its newest checkpoint (docs/training.md)


def complete_checkpoints(run_dir) -> list[tuple[int, Path]]:
    root = Path(run_dir) / FOLDER
    found = []
    for path in root.glob(PREFIX + "*") if root.is_dir() else []:
        if (path / "meta.json").is_file() and path.name[len(PREFIX):].isdigit():
            found.append((int(path.name[len(PREFIX):]), path))
    return sorted(found)


def save_checkpoint(accelerator, run_dir, step: int, data_state: dict, recipe_flat: dict, keep: int,
                    window: dict | None = None, knob: list[float] | None = None, sharded=None) -> Path:
    """Every process calls this (accelerate writes each process's RNG state); the main one commits.
    window: the open log window (loss sum, items) so a resumed run logs the same mean. knob: a recovery
    schedule's knob value per layer at this step (resume recomputes it from the step and checks it).
    sharded: (model, optimizer) under train.fsdp, whose shards every process writes itself (see write_state)."""
    root = Path(run_dir) / FOLDER
    final, tmp = root / f"{PREFIX}{step:07d}", root / f"{TMP}{PREFIX}{step:07d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP + "*"):
            remove_owned(stale, root)  # a .tmp- folder without our marker is not ours to delete
        if tmp.exists():
            raise RetrofitError(f"{tmp} is in the way and was not made by retrofit; move it away and resume")
        owned_folder(tmp)
    accelerator.wait_for_everyone()
    with _disk_full_is_one_line(accelerator, tmp, run_dir, step):
        write_state(accelerator, tmp, sharded)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {"step": step, "data": data_state, "recipe": recipe_flat, "processes": accelerator.num_processes,
                "time": time.time(), "window": window, "knob": knob}
        with _disk_full_is_one_line(accelerator, tmp, run_dir, step):
            (tmp / "meta.json").write_text(json.dumps(meta))
            fsync_tree(tmp)
            write_manifest(tmp)  # written last: what verify() checks before any resume uses the folder
        # re-reached after a resume: the older copy goes first (a kill now keeps tmp only)
        if final.exists() and not remove_owned(final, root):
            raise RetrofitError(f"{final} exists and was not written by retrofit; move it away and resume")
        os.rename(tmp, final)
        fsync_tree(root)
        for _, old in complete_checkpoints(run_dir)[:-keep]:
            remove_owned(old, root)
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def _disk_full_is_one_line(accelerator, tmp: Path, run_dir, step: int):
    """A write that failed for want of room while writing checkpoint `step` (a full disk, a used-up quota, a file
    past the size limit: errors.write_failure): the half-written .tmp- folder is removed (its space given back;
    nothing loads it anyway) and the error is one line saying so. The checkpoints before it are untouched, so the run
    resumes from the newest of them once there is room."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        reason = write_failure(err)
        if reason is None:
            raise
        if accelerator.is_main_process:
            remove_owned(tmp, tmp.parent)
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise RetrofitError(f"{reason}: checkpoint step {step} could not be written in {Path(run_dir)} "
                            f"({detail}); make room, then continue with `retrofit train RECIPE --resume "
                            f"{Path(run_dir)}` (it resumes from the last complete checkpoint)") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))


def write_manifest(folder: Path) -> None:
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(folder)}
    atomic_write_text(folder / MANIFEST, json.dumps({"files": files}, indent=1))


def verify(folder: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest, else what is wrong, naming the file.
    A checkpoint written before manifests existed (no marker, no manifest) is taken as it is."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return f"{MANIFEST} is missing" if (folder / MARKER).is_file() else None
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, its manifest says {want['size']}"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def resume_checkpoint(accelerator, run_dir, recipe_flat: dict, sharded=None) -> tuple[Path, dict] | None:
    """Load the newest checkpoint that verifies, naming each damaged one it passes over; None when the run
    has no checkpoint at all, an error when it has some and every one is damaged."""
    found = complete_checkpoints(run_dir)
    problems = []
    for i, (_, path) in enumerate(reversed(found)):
        problem = verify(path)
        if problem is None:
            return path, load_checkpoint(accelerator, path, recipe_flat, sharded)
        older = found[-2 - i][1].name if i + 1 < len(found) else None
        accelerator.print(f"checkpoint {path} is damaged: {problem}; "
                          + (f"falling back to {older}" if older else "no older checkpoint"))
        problems.append(f"{path.name}: {problem}")
    if problems:
        raise RetrofitError(f"no usable checkpoint in {Path(run_dir) / FOLDER} ({'; '.join(problems)}); "
                            "restore it or start the run again in another output.dir")
    return None


def write_state(accelerator, folder: Path, sharded=None) -> None:
    """accelerate's save_state (a seam the tests use to simulate a crash mid-write). Under train.fsdp
    (sharded = (model, optimizer)) accelerate would write the optimizer from the main process alone, which holds
    1/world of it: every process writes its own shards (torch.distributed.checkpoint), accelerate the RNG states.
    Under DeepSpeed (sharded = (engine, optimizer)) every process writes its partition (DeepSpeed's files, zero.py)."""
    if sharded is None:
        accelerator.save_state(str(folder))
        return
    from accelerate.checkpointing import save_accelerator_state
    if zero.is_engine(sharded[0]):
        zero.save_state(folder, sharded[0])
    else:
        fsdp.save_shards(folder, *sharded)
    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step,
                           accelerator.scaler if accelerator.is_main_process else None)


def extends(saved: dict, current: dict) -> bool:
    """Whether `current` (a flat recipe) raises the saved one's train.steps: resuming it extends the run."""
    old, new = saved.get(EXTENDABLE), current.get(EXTENDABLE)
    return isinstance(old, int) and isinstance(new, int) and new > old


def check_same_recipe(saved: dict, current: dict, where) -> None:
    """The recipe a run resumes with is the one it was trained with, but for what never changes a step (_IGNORED)
    and a raised train.steps (the run is extended)."""
    keys = sorted(k for k in set(saved) | set(current) if not k.startswith(_IGNORED) and saved.get(k) != current.get(k)
                  and not (k == EXTENDABLE and extends(saved, current)))
    if keys:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys[:3])
        hint = "; train.steps can only be raised (that extends the run)" if EXTENDABLE in keys else ""
        raise RetrofitError(f"cannot resume {where}: the recipe differs from the one it was trained with ({shown}"
                            f"{', ...' if len(keys) > 3 else ''}){hint}; resume with the original recipe")


def load_checkpoint(accelerator, path: Path, recipe_flat: dict, sharded=None) -> dict:
    """Restore model, optimizer and RNG states into the prepared objects (sharded: as write_state); returns
    meta.json. Every pickled file is checked as data before anything is restored (check_state_files)."""
    meta = read_json(path / "meta.json")
    check_same_recipe(expect(meta.get("recipe"), dict, f"{path / 'meta.json'}: recipe"), recipe_flat, path)
    if meta.get("processes") != accelerator.num_processes:
        raise RetrofitError(f"{path} was written by {meta.get('processes')} process(es), this run has "
                            f"{accelerator.num_processes}; resume with the same number of processes")
    rng = check_state_files(path, accelerator.process_index)
    if sharded is None:
        accelerator.load_state(str(path), load_kwargs={"weights_only": True})
    else:
        from accelerate.checkpointing import load_accelerator_state
        if zero.is_engine(sharded[0]):  # DeepSpeed's own files, in a subfolder, read weights-only (zero.py)
            zero.load_state(path, sharded[0])
        else:
            fsdp.load_shards(path, *sharded)
        restored = load_accelerator_state(str(path), [], [], [], [], accelerator.process_index, accelerator.scaler,
                                          load_kwargs={"weights_only": True})
        for key, value in restored.items():  # what load_state sets too (its step counter)
            setattr(accelerator, key, value)
    restore_rng(rng)  # accelerate sets them inside a try/except that only logs "Could not load random states"
    return meta


# ---- accelerate's pickled files, read as data -----------------------------------------------------------------------

RNG = "random_states_{}.pkl"


def _numpy_globals() -> list:
    """What numpy's RNG state pickles as (accelerate saves np.random.get_state()): arrays of uint32, nothing else."""
    import codecs

    import numpy as np
    return [np.zeros(1).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32)), codecs.encode]


def read_state_file(path: Path):
    """A file accelerate pickled (torch.save), read by torch's weights-only unpickler: tensors, numbers, strings,
    containers and numpy's arrays; anything else (a class, a function: code) is a one-line RetrofitError naming the
    file. mmap: the tensors' bytes are not read, only the structure."""
    import torch
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 -- whatever torch raises on it: not a file it can read as data
        raise fsdp.not_data(path, err) from None


def check_state_files(folder: Path, process_index: int) -> dict:
    """Every pickled file of checkpoint `folder` read as data (read_state_file), before anything is restored; returns
    this process's RNG states, each checked by setting it on a scratch generator."""
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".pkl", ".pt")):
        read_state_file(path)
    path = folder / RNG.format(process_index)
    if not path.is_file():
        raise RetrofitError(f"{folder} holds no {path.name}: its RNG states are missing; restore the run folder")
    states = expect(read_state_file(path), dict, str(path))
    for key, what, check in _RNG_CHECKS:
        if key not in states:
            raise RetrofitError(f"{path} holds no {key}: it is not the RNG state accelerate saves; restore the run "
                                "folder")
        try:
            check(states[key])
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise RetrofitError(f"{path}: {key} is not {what} ({' '.join(str(err).split())[:80]}); restore the run "
                                "folder") from None
    return states


def _torch_state(value) -> None:
    import torch
    torch.Generator().set_state(value)


def _numpy_state(value) -> None:
    import numpy as np
    np.random.RandomState().set_state(value)


_RNG_CHECKS = (("random_state", "a Python random state", lambda v: random.Random().setstate(v)),
               ("numpy_random_seed", "a numpy random state", _numpy_state),
               ("torch_manual_seed", "a torch random state", _torch_state))


def restore_rng(states: dict) -> None:
    """Set Python's, numpy's and torch's generators (and CUDA's, when saved and present) from checked states."""
    import numpy as np
    import torch
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
