"""What push publishes of this machine: names, never local paths; never what a symbolic link points to.

    check_no_links([(Path("runs/x"), True)])   # a link anywhere in the folder: one-line refusal
    public_path("/home/me/runs/x")             # -> "x"  (Hub ids and other values as they are)
    public_recipe(text)                        # recipe.yaml with its local paths as names
    public_json(results, public)               # eval results.json with every string passed through `public`
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import RetrofitError
from ..load.sources import is_hub_id
from ..recipe import load_yaml


def first_link(folder: Path, named: bool = False) -> Path | None:
    """The first symbolic link in `folder`'s tree (the folder itself too, unless the user named it on the command
    line), or None. os.walk does not follow links to folders, so nothing outside `folder` is looked at."""
    if not named and folder.is_symlink():
        return folder
    for parent, folders, files in os.walk(folder):
        for name in sorted(folders + files):
            if (Path(parent) / name).is_symlink():
                return Path(parent) / name
    return None


def check_no_links(folders) -> None:
    """Refuse, before anything is staged, any symbolic link in the folders push reads from: a link's target may
    be anything on this machine (a private key, /etc/passwd) and would be published. Links that stay inside
    the folder are refused too: one rule, no resolving, nothing to get wrong. `folders`: (folder, named)."""
    for folder, named in folders:
        found = first_link(folder, named)
        if found is not None:
            where = found.relative_to(folder).as_posix() if found != folder else found.name
            raise RetrofitError(f"{where} in {folder} is a symbolic link; push never publishes what a link points "
                                "to: replace it with a copy of the file, or remove it")


# recipe keys that hold local paths: published as file names (a reader's machine has none of this one's folders)
LOCAL_PATH_KEYS = {"model": ("source", "tokenizer"), "data": ("files", "val_files", "cache_dir"), "output": ("dir",)}


def public_path(value):
    """A local path as it is published: its name (`/home/me/runs/x` -> `x`); Hub ids and other values as they are."""
    if not isinstance(value, str) or is_hub_id(value):
        return value
    looks_local = os.path.isabs(os.path.expanduser(value)) or os.path.exists(value) or os.sep in value
    return Path(value).name if looks_local and Path(value).name else value


# of those, what a rerun needs from the reader (output.dir and data.cache_dir are the reader's to choose)
RERUN_KEYS = ("model.source", "model.tokenizer", "data.files", "data.val_files")


def rerun_keys(raw: dict) -> list[str]:
    """The dotted recipe keys (RERUN_KEYS) whose values are paths on this machine: published as names, so a reader
    reruns the recipe by giving them on the command line."""
    keys = []
    for key in RERUN_KEYS:
        section, name = key.split(".")
        value = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
        if any(public_path(v) != v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)):
            keys.append(key)
    return keys


def public_recipe(text: str) -> str:
    """recipe.yaml with every local path replaced by its name (comments and layout kept: text replacement)."""
    raw = load_yaml(text, "recipe.yaml") or {}
    found = []
    for section, keys in LOCAL_PATH_KEYS.items():
        for key in keys:
            value = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
            found += value if isinstance(value, list) else [value]
    for value in sorted({v for v in found if isinstance(v, str)}, key=len, reverse=True):  # longest first
        if public_path(value) != value:
            text = text.replace(value, public_path(value))
    return text


def is_local(value) -> bool:
    """A string that names a path on this machine (absolute, or an existing relative path with a folder in it)."""
    if not isinstance(value, str) or not value or public_path(value) == value:
        return False
    return os.path.isabs(os.path.expanduser(value)) or (os.sep in value and os.path.exists(value))


def local_paths(value) -> set[str]:
    """Every string in a results.json (any depth) that names a local path: model sources, data files, tokenizers."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(local_paths(v) for v in value)) if value else set()
    return {value} if is_local(value) else set()


def public_json(value, public):
    """`value` with `public` applied to every string in it (keys kept)."""
    if isinstance(value, dict):
        return {k: public_json(v, public) for k, v in value.items()}
    if isinstance(value, list):
        return [public_json(v, public) for v in value]
    return public(value) if isinstance(value, str) else value
