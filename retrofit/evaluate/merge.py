"""Several finished evaluations as one: `retrofit eval --merge A/results.json B/results.json --out DIR`.

    results = merge_results(["eval-16k/results.json", "eval-32k/results.json"], reference="softmax-dynamic")

An expensive length is often run on its own (a 32K window costs minutes per model on a CPU), or a model is added
later. Per-window losses are stored, so nothing needs re-scoring: the models are put side by side, a model that
appears in several files (same name, same source and patch) gets all its rows, and the paired differences are
computed afresh. Rows pair exactly when the windows are the same (equal `windows_sha1`), as in one run; otherwise
they are reported unpaired with the reason (retrofit.evaluate.compare).
"""

from __future__ import annotations

import copy

from ..errors import RetrofitError
from ..io.readers import read_json
from .compare import judged
from .report import validate

ROWS = ("lengths", "passkey", "counting", "ruler")  # a model's per-task row lists
# What makes two entries one model: the weights' source and the patch in effect (`retrofit`, read after any on-the-fly
# patch; not `eval_patch`, which only says how it got there: a --rope the model already carries changes nothing).
SAME_MODEL = ("source", "model_type", "tokenizer", "retrofit", "rope", "arm", "seed")


def read_results(path, what: str = "--merge") -> dict:
    """A results.json retrofit eval (or an experiment's eval/) wrote, validated; a one-line error otherwise."""
    return checked_results(read_json(path, what=what), f"{what} {path}".strip())


def checked_results(results: dict, label: str) -> dict:
    """`results` (a mapping read from `label`) when it is an eval results.json by its schema, else a one-line error."""
    try:
        validate(results)
    except RetrofitError as err:
        raise RetrofitError(f"{label}: not a retrofit eval results.json ({err})") from None
    return results


def merge_results(paths: list, reference=None) -> dict:
    """One results dict from several: models side by side (one entry per name), lengths united, comparisons
    recomputed with `reference` (None: the first model). The data must be the same documents."""
    if len(paths) < 2:
        raise RetrofitError("--merge needs at least two results.json files")
    parts = [read_results(p) for p in paths]
    first = parts[0]
    merged = copy.deepcopy(first)
    merged["settings"] = {**first.get("settings", {}), "merged_from": [str(p) for p in paths]}
    by_name = {m["name"]: m for m in merged["models"]}
    for path, part in zip(paths[1:], parts[1:]):
        _check_same_data(first, part, paths[0], path)
        for model in part["models"]:
            mine = by_name.get(model["name"])
            if mine is None:
                by_name[model["name"]] = copy.deepcopy(model)
                merged["models"].append(by_name[model["name"]])
            else:
                _add_rows(mine, model, path)
    for model in merged["models"]:
        for key in ROWS:
            if model.get(key):
                model[key].sort(key=lambda r: (r["length"], r.get("task", ""), r.get("depth", 0)))
    merged["lengths"] = sorted({length for part in parts for length in part["lengths"]})
    merged["schema"] = max(part["schema"] for part in parts)
    merged = judged(merged, reference)  # paired differences (and the seed summary) from the per-window losses
    validate(merged)
    return merged


def _check_same_data(first: dict, part: dict, first_path, path) -> None:
    if first.get("train_len") != part.get("train_len"):
        raise RetrofitError(f"--merge: {first_path} marks train length {first.get('train_len')}, {path} "
                            f"{part.get('train_len')}: merge evaluations run with the same --train-len")
    mine, theirs = (r.get("data", {}).get("documents") for r in (first, part))
    if mine != theirs:
        raise RetrofitError(f"--merge: {first_path} and {path} were scored on different data (document token counts "
                            f"{mine} vs {theirs}): their windows cannot be paired")


def _add_rows(mine: dict, other: dict, path) -> None:
    """Another file's rows of the same model into `mine`; a different model under the same name, or a row scored
    twice, is refused (rename one with --names when evaluating)."""
    differ = [key for key in SAME_MODEL if mine.get(key) != other.get(key)]
    if differ:
        raise RetrofitError(f"--merge: two different models are named {mine['name']!r} ({', '.join(differ)} differ, "
                            f"in {path}): evaluate one with another --names")
    for key in ROWS:
        rows = other.get(key) or []
        have = {(r["length"], r.get("task"), r.get("depth")) for r in mine.get(key) or []}
        twice = [r["length"] for r in rows if (r["length"], r.get("task"), r.get("depth")) in have]
        if twice:
            raise RetrofitError(f"--merge: {mine['name']} has {key} rows at length {twice[0]} in two files "
                                f"(again in {path}): merge files that score different lengths or models")
        if rows:
            mine.setdefault(key, []).extend(copy.deepcopy(rows))
