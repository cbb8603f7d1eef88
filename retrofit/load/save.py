"""The one way retrofit saves a model: `save_model`, atomically, into a new folder or a run folder.

    save_model(model, "gpt2-avnorm", tokenizer=tok, what="--out")    # a new (or empty) folder, made whole
    save_model(model, "runs/lora", peft_save="both", into_run=True)  # a run folder retrofit made: its files

`retrofit patch --out`, a training run's final save (train.loop.save_final) and the Python API all come here
(tests/load/test_one_save_path.py checks). The model is written into a temporary folder first, then renamed into
place, so a kill mid-save never leaves a truncated model.safetensors under its final name:

    new folder  -> atomic.atomic_folder: the temporary sibling `.NAME.XXXX` becomes NAME (new or empty; a folder of
                   the user's files is refused in one line, nothing touched)
    into_run    -> RUN/.tmp-final (made with retrofit's marker), then each file (or folder: adapter/) in it renamed
                   into RUN; a file it replaces is one retrofit wrote there before (a resumed run's final save)
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from ..io.atomic import MARKER, atomic_folder, owned_folder, remove_owned
from ..io.fs import fsync_dir, fsync_tree
from .adapters import BASE_DIR, peft_save_options, save_loadable_base
from .task_model import HEAD_FILE, TASK_FILE, CountingModel, language_model

ADAPTER_DIR = "adapter"  # a LoRA run's adapter, beside its recipe.yaml (train.peft.save: adapter or both)
STAGING = ".tmp-final"  # inside a run folder: the final model before it is renamed into place


def save_model(model: nn.Module, out, *, tokenizer=None, peft_save: str | None = None, state_dict=None,
               into_run: bool = False, what: str = "folder") -> nn.Module:
    """Write `model` (and `tokenizer`) to `out` atomically; returns the model as saved (a LoRA model comes back
    merged when the merged form was written). into_run: `out` is a run folder retrofit made (its recipe.yaml,
    log.jsonl stay), else a new or empty folder (`what` names it in a refusal: "--out"). peft_save: a PEFT model's
    adapter | merged | both. state_dict: a sharded model's, gathered. Call on the main process with the unwrapped
    model."""
    if into_run:
        with _staged_files(Path(out)) as tmp:
            return _write_model(model, tmp, tokenizer, peft_save, state_dict, final_dir=Path(out))
    with atomic_folder(out, what) as tmp:
        return _write_model(model, tmp, tokenizer, peft_save, state_dict, final_dir=Path(os.path.expanduser(str(out))))


def _write_model(model: nn.Module, folder: Path, tokenizer, peft_save: str | None, state_dict, *,
                 final_dir: Path) -> nn.Module:
    """The files of the model into `folder` (a temporary one: save_model renames it); final_dir: where they will be
    (the adapter names its base/ there)."""
    lm = language_model(model)
    gathered = state_dict
    if state_dict is not None and isinstance(model, CountingModel):
        state_dict = {k[3:]: v for k, v in state_dict.items() if k.startswith("lm.")}
    if peft_save is not None:
        if peft_save in ("adapter", "both"):  # state_dict (a sharded model's, gathered): the adapter's part of it
            lm.save_pretrained(folder / ADAPTER_DIR, **({"state_dict": state_dict} if state_dict else {}),
                               **peft_save_options(lm))
            save_loadable_base(lm, folder / ADAPTER_DIR, folder / BASE_DIR, state_dict,  # a .gguf / pkg: base
                               named_as=final_dir / BASE_DIR)
        if peft_save in ("merged", "both"):
            lm = lm.merge_and_unload()
            lm.save_pretrained(folder)
            if isinstance(model, CountingModel):
                model.lm = lm
    else:
        lm.save_pretrained(folder, state_dict=state_dict)
    if isinstance(model, CountingModel):
        save_file(model.task_state(gathered), str(folder / HEAD_FILE))
        (folder / TASK_FILE).write_text(json.dumps({"task": "counting", "head": "linear",
                                                    "hidden_size": model.head.in_features,
                                                    "first_token": model.first_token is not None}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model if isinstance(model, CountingModel) else lm


@contextlib.contextmanager
def _staged_files(run_dir: Path):
    """A temporary folder inside the run folder; on success each file (or folder: adapter/) in it is renamed
    into run_dir, so a kill mid-save never leaves a truncated model.safetensors under its final name."""
    tmp = run_dir / STAGING
    remove_owned(tmp, run_dir)  # left by a kill during an earlier save
    owned_folder(tmp)
    yield tmp
    fsync_tree(tmp)
    old = owned_folder(tmp / ".replaced")  # what the new files replace goes here, then with tmp
    for entry in sorted(tmp.iterdir()):
        if entry.name in (".replaced", MARKER):
            continue
        target = run_dir / entry.name
        if target.is_dir() and not target.is_symlink():  # a folder (adapter/) cannot be replaced in one rename
            os.replace(target, old / entry.name)
        os.replace(entry, target)
    fsync_dir(run_dir)
    remove_owned(tmp, run_dir)
