"""The experiment's results: every model evaluated at every length it can take (DIR/eval/results.json, reused for
checkpoints that did not change), each arm's outcome, and DIR/results.json with the report.md built from it.

driver.py runs the stages and hands over what they left; nothing here trains.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import RetrofitError
from ..evaluate import EvalSpec, evaluate_models
from ..evaluate.compare import with_comparisons
from ..io.atomic import atomic_write_text
from ..io.readers import read_json
from ..load import load_config, training_dtype
from ..positions import learned_position_limit
from ..recipe import ArmSection, ExperimentSection, Recipe, to_plain
from .labels import trained_patch
from .report import write_experiment_report


def learned_limit(source: str) -> int | None:
    """The length bound of a model with learned absolute positions (GPT-2), unless patched with NoPE."""
    config = load_config(source)
    return learned_position_limit(config, nope=bool((getattr(config, "retrofit", None) or {}).get("nope")))


def _finished_at(source: str) -> float:
    """When a local checkpoint was finished (0 for Hub ids and packaged models, which do not change)."""
    path = Path(source)
    if (path / "result.json").is_file():
        return (path / "result.json").stat().st_mtime
    return path.stat().st_mtime if path.exists() else 0.0


def within(source: str, out: Path) -> str:
    """A checkpoint of this experiment by its place in DIR, else as given (so a moved DIR keeps its evaluation and
    its base)."""
    try:
        return Path(source).resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return str(source)


def _reusable(previous: dict | None, source: str, name: str, lengths: list[int], out: Path) -> dict | None:
    """The entry of `name` in a previous evaluation of this experiment, cut to `lengths`, if it measured
    this very checkpoint (evaluated after it was finished) at every one of them; else None."""
    entry = next((m for m in (previous or {}).get("models", []) if m["name"] == name), None)
    if entry is None or entry["evaluated_at"] < _finished_at(source):
        return None
    if entry.get("checkpoint", entry.get("source")) not in (within(source, out), str(source)):
        return None
    entry = dict(entry)
    for key in ("lengths", "counting", "passkey"):
        if entry.get(key):
            if not set(lengths) <= {r["length"] for r in entry[key]}:
                return None
            entry[key] = [r for r in entry[key] if r["length"] in lengths]
    return entry


def _previous_evaluation(path: Path, recipe: Recipe, exp: ExperimentSection) -> dict | None:
    """DIR/eval/results.json of an earlier run, if it used the same data, token cap and trained length, and was
    written with intervals (the same windows and per-window losses as a new evaluation).
    Each model entry carries `evaluated_at` (entries written without it date from the file)."""
    if not path.is_file():
        return None
    previous = read_json(path)
    same = (previous.get("data", {}).get("files") == [str(p) for p in exp.eval_data or []]
            and previous.get("settings", {}).get("max_tokens") == exp.eval_max_tokens
            and previous.get("train_len") == (exp.train_len or recipe.data.seq_len)
            and previous.get("settings", {}).get("counting") == _counting_options(exp)
            and previous.get("settings", {}).get("eval_variants") == exp.eval_variants
            # older retrofits wrote no intervals: capped windows were chosen another way, per-window losses absent
            and "intervals" in previous.get("settings", {}))
    if not same:
        return None
    for entry in previous["models"]:
        entry.setdefault("evaluated_at", path.stat().st_mtime)
    return previous


def _counting_options(exp: ExperimentSection) -> dict | None:
    """evaluate_counting's options the experiment sets (None: its defaults)."""
    options = {k: v for k, v in (("sequences", exp.eval_sequences), ("prefixes", exp.eval_prefixes or None)) if v}
    return options or None


def evaluate_all(sources: list[str], names: list[str], recipe: Recipe, exp: ExperimentSection, progress: bool,
                 out: Path, labels: dict | None = None) -> tuple[dict, list[str]]:
    """Every model at every length it can take: a model with learned positions (a GPT-2 base next to
    NoPE arms) is evaluated up to its table and the report shows '—' beyond. Each model's results are
    saved to DIR/eval/results.json as soon as it is done, and a re-run reuses those of unchanged
    checkpoints, so a crash in the last model's longest window does not redo the others.
    `labels`: name -> fields its entry carries (`arm`, `seed` for the runs of an experiment with seeds).
    Returns (the evaluation, names of the models whose earlier results were reused)."""
    lengths = sorted(set(recipe.eval_lengths()))
    saved = out / "eval" / "results.json"
    previous = _previous_evaluation(saved, recipe, exp)
    merged, reused = None, []
    sources, names, ropes, labels = _variants(sources, names, exp.eval_variants, labels or {})
    for source, name, rope in zip(sources, names, ropes):
        limit = learned_limit(source)
        allowed = [n for n in lengths if limit is None or n <= limit]
        if not allowed:
            print(f"[experiment] {name}: every evaluation length exceeds its {limit} learned positions; skipped")
            continue
        entry = _reusable(previous, source, name, allowed, out)
        if entry is not None:
            print(f"[experiment] eval {name}: reusing its results in {saved}")
            one = dict(previous, models=[entry])
            reused.append(name)
        else:
            t0 = time.perf_counter()
            spec = EvalSpec(names=[name], data=exp.eval_data, lengths=allowed,
                            train_len=exp.train_len or recipe.data.seq_len, max_tokens=exp.eval_max_tokens,
                            tokenizer=recipe.model.tokenizer, progress=progress, counting=_counting_options(exp),
                            dtype=training_dtype(recipe.model.dtype), rope=rope)  # the base as the arms: same dtype
            one = evaluate_models([source], spec)
            one["models"][0] |= {"checkpoint": within(source, out), "evaluated_at": time.time(),
                                 "eval_s": round(time.perf_counter() - t0, 1)}
        one["models"][0] |= (labels or {}).get(name, {})
        merged = one if merged is None else dict(merged, models=merged["models"] + one["models"])
        merged["lengths"] = lengths
        merged["settings"] = {**(merged.get("settings") or {}), "eval_variants": exp.eval_variants}
        if entry is None:  # progress on disk, keeping the earlier entries not yet reached
            done = {m["name"] for m in merged["models"]}
            later = [m for m in (previous or {}).get("models", []) if m["name"] not in done]
            atomic_write_text(saved, json.dumps(dict(merged, models=merged["models"] + later), indent=1) + "\n")
    if merged is None:
        raise RetrofitError("no model could be evaluated at any of eval.lengths")
    control = f"{exp.control}+{exp.eval_variants[0]['name']}" if exp.eval_variants else exp.control
    return with_comparisons(merged, control), reused


def _variants(sources: list[str], names: list[str], variants: list[dict] | None, labels: dict) -> tuple:
    """(sources, names, ropes, labels), each source once per experiment.eval_variants entry: named NAME+VARIANT,
    labelled with its variant and the arm it was trained as (arm ARM+VARIANT under seeds), so that
    retrofit.evaluate.seeds pairs every arm with the control under the same variant. No variants: as given."""
    if not variants:
        return sources, names, [None] * len(sources), labels
    out = ([], [], [], {})
    for source, name in zip(sources, names):
        for v in variants:
            full = f"{name}+{v['name']}"
            trained = labels.get(name, {}).get("arm", name)
            for column, value in zip(out[:3], (source, full, v.get("rope"))):
                column.append(value)
            out[3][full] = labels.get(name, {}) | {"arm": f"{trained}+{v['name']}", "variant": v["name"],
                                                   "trained_as": trained}
    return out


# ---- results.json --------------------------------------------------------------------------------------------------

def final_train_loss(run_dir: Path) -> float | None:
    """The run's training loss over its last log window (result.json final_loss), or None (failed, not run)."""
    result = run_dir / "result.json"
    return read_json(result).get("final_loss") if result.is_file() else None



def arm_results(out: Path, runs: list[ArmSection], failures: dict, recovery: dict, labels: dict) -> dict:
    """results.json's `arms`: for each run, the patch it trained with (read back from its folder), its settings,
    its failure (one line) or None, its last training loss and its recovery curve, and its arm and seed labels."""
    return {a.name: {"patch": trained_patch(out / "arms" / a.name, a),
                     "settings": {"lr": a.lr, "recovery": to_plain(a.recovery)},
                     "failed": failures.get(a.name),
                     "train_loss": final_train_loss(out / "arms" / a.name),
                     "recovery": recovery.get(a.name)} | labels.get(a.name, {})
            for a in runs}


def write_results(results: dict, out: Path) -> None:
    """DIR/results.json and DIR/report.md, from the experiment's results."""
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    write_experiment_report(results, out)
