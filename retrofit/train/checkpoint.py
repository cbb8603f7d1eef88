"""Resumable checkpoints, written atomically.

    run/checkpoints/step-0000100/   model, optimizer, RNG of every process (accelerate's save_state),
                                    meta.json: step, data position, the recipe it was trained with

A checkpoint is written into `.tmp-step-...`, its files fsynced, `meta.json` written last, and only
then renamed to `step-...`. A rename is atomic, so a kill at any moment leaves either the complete
checkpoint or a `.tmp-` folder that nothing ever loads (and the next save deletes). Resume takes the
newest `step-*` folder that has meta.json and refuses one trained with a different recipe.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from ..errors import RetrofitError

FOLDER, PREFIX, TMP = "checkpoints", "step-", ".tmp-"

# Keys that may differ between the run and its resumption without changing the result.
_IGNORED = ("name", "output.", "train.progress", "train.log_every", "eval.")


def complete_checkpoints(run_dir) -> list[tuple[int, Path]]:
    root = Path(run_dir) / FOLDER
    found = []
    for path in root.glob(PREFIX + "*") if root.is_dir() else []:
        if (path / "meta.json").is_file() and path.name[len(PREFIX):].isdigit():
            found.append((int(path.name[len(PREFIX):]), path))
    return sorted(found)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(accelerator, run_dir, step: int, data_state: dict, recipe_flat: dict, keep: int) -> Path:
    """Every process calls this (accelerate writes each process's RNG state); the main one commits."""
    root = Path(run_dir) / FOLDER
    final, tmp = root / f"{PREFIX}{step:07d}", root / f"{TMP}{PREFIX}{step:07d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP + "*"):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    write_state(accelerator, tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {"step": step, "data": data_state, "recipe": recipe_flat, "processes": accelerator.num_processes,
                "time": time.time()}
        _fsync_tree(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta))  # written last: its presence marks completeness
        _fsync_tree(tmp)
        if final.exists():  # re-reached after a resume: the older copy goes first (a kill now keeps tmp only)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_tree(root)
        for _, old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_state(accelerator, folder: Path) -> None:
    """accelerate's save_state (a seam the tests use to simulate a crash mid-write)."""
    accelerator.save_state(str(folder))


def check_same_recipe(saved: dict, current: dict, where) -> None:
    keys = sorted(k for k in set(saved) | set(current) if not k.startswith(_IGNORED) and saved.get(k) != current.get(k))
    if keys:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys[:3])
        raise RetrofitError(f"cannot resume {where}: the recipe differs from the one it was trained with ({shown}"
                            f"{', ...' if len(keys) > 3 else ''}); resume with the original recipe")


def load_checkpoint(accelerator, path: Path, recipe_flat: dict) -> dict:
    """Restore model, optimizer and RNG states into the prepared objects; returns meta.json."""
    meta = json.loads((path / "meta.json").read_text())
    check_same_recipe(meta["recipe"], recipe_flat, path)
    if meta["processes"] != accelerator.num_processes:
        raise RetrofitError(f"{path} was written by {meta['processes']} process(es), this run has "
                            f"{accelerator.num_processes}; resume with the same number of processes")
    accelerator.load_state(str(path))
    return meta
