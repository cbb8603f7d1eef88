"""Diagnose sources: load each model (and, on request, a patched variant), read the text, run the measures.

    diagnose_sources(["runs/demo/base", "./smollm2.gguf"],
                     DiagnoseSpec(data="book.txt", out="diag/", lengths=[32, 64, 128], patches=["avnorm"]))

The CLI over it is retrofit/commands/diagnose.py (`retrofit diagnose`).
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

from ..calibration import calibrate
from ..data.read import read_tokens
from ..errors import RetrofitError, check_utf8
from ..io.atomic import atomic_write_text, check_output, output_folder
from ..load import load, load_tokenizer
from ..load.preflight import check_eval_memory
from ..norms import get_norm
from ..patching import patch, patch_record
from ..positions import position_limit
from .collect import Plan, diagnose_model
from .figures import write_report
from .spec import DiagnoseSpec, parse_patches
from .summary import summarize

SCHEMA = "retrofit.diagnose/1"  # diagnose.json: {schema, header, models: [summary.summarize results]}


def _label(source: str) -> str:
    p = Path(source.rstrip("/"))
    return p.stem if source.endswith(".gguf") else p.name or source


def _windows(tokens: torch.Tensor, count: int, length: int, reserve: int,
             data: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` non-overlapping windows of `length` tokens spread over the text, and the `reserve`
    tokens after the last window (for calibration)."""
    need = count * length + reserve
    if len(tokens) < need:
        raise RetrofitError(f"{data} has {len(tokens)} tokens but {count} window(s) of {length} tokens"
                            + (f" plus {reserve} calibration tokens" if reserve else "")
                            + f" need {need}: pass a longer --data, smaller --lengths or fewer --windows")
    room = len(tokens) - reserve - count * length
    starts = [i * length + (room * i) // max(count - 1, 1) for i in range(count)]
    windows = torch.stack([tokens[s:s + length] for s in starts])
    return windows, tokens[len(tokens) - reserve:]


def diagnose(model, windows, plan: Plan, *, label: str = "model", progress: bool = True,
             meta: dict | None = None) -> dict:
    """Run every measure of `plan` on `model` over `windows` (B, T) and return the JSON-ready result."""
    raw = diagnose_model(model, windows, plan, label=label, progress=progress)
    return summarize(raw["acc"], plan, {"label": label, **(meta or {}), "windows": raw["windows"]})


def _variants(patches, source, label, model):
    """(label, model, norm, patch info, patched here?) for the source itself and each --patch."""
    record = patch_record(model)
    yield label, model, (record or {}).get("norm"), record, False
    for spec in parse_patches(patches):
        if record:
            raise RetrofitError(f"{source} is already patched with {record['norm']}; --patch applies to "
                                "unpatched sources only")
        variant = copy.deepcopy(model)  # deep-copies its config too: the original stays unpatched
        report = patch(variant, spec)
        yield f"{label}+{spec.norm}", variant, spec.norm, report.as_dict(), True


def _diagnose_source(spec: DiagnoseSpec, source: str, label: str, plan, calibrate_tokens: int, tokenizer):
    """Every result for one source: the model as it is, then each --patch variant. Returns (results, tokens)."""
    tokenizer = tokenizer or load_tokenizer(source)
    if tokenizer is None:
        raise RetrofitError(f"{source} has no tokenizer; pass --tokenizer (e.g. a folder with tokenizer.json)")
    tokens = read_tokens(spec.data, tokenizer, "--data")  # windows spread over all of it: every token, int64
    Lmax = plan.lengths[-1]
    windows, calib = _windows(tokens, spec.windows, Lmax, calibrate_tokens, spec.data)
    model = load(source, task_head=False, dtype=spec.dtype)
    limit = position_limit(model)
    if limit is not None and Lmax > limit:
        raise RetrofitError(f"{source} has learned positions for {limit} tokens only; use --lengths up to {limit}")
    if windows.max() >= model.get_input_embeddings().num_embeddings:
        raise RetrofitError(f"the tokenizer makes ids beyond {source}'s vocabulary: pass the model's own --tokenizer")
    results = []
    for name, variant, norm, info, fresh in _variants(spec.patches, source, label, model):
        if fresh and get_norm(norm).calibrated_by_default and calibrate_tokens:  # a fresh AVNorm: calibrated gains
            info = {**info, "calibration": calibrate(variant, _calibration_rows(calib, min(Lmax, 512)),
                                                     progress=spec.progress)}
        result = diagnose(variant, windows, plan, label=name, progress=spec.progress,
                          meta={"source": source, "norm": norm, "patch": _brief(info)})
        print(_headline(result), file=sys.stderr)
        results.append(result)
    return results, len(tokens)


def diagnose_sources(sources: list[str], spec: DiagnoseSpec) -> Path:
    """Diagnose every source (and each patched variant of `spec.patches`) on `spec.data`; writes diagnose.json,
    report.md and the figures into `spec.out` and returns that folder."""
    out = check_output(spec.out, "--out")  # new, empty or made by retrofit: refused before any model loads
    labels = spec.labels
    if labels and len(labels) != len(sources):
        raise RetrofitError(f"--label was given {len(labels)} time(s) for {len(sources)} source(s)")
    check_utf8(spec.data, "--data")  # the one text rule (retrofit.errors): UTF-8 or a one-line error
    # each source loads and one window of the longest length fits: before any tokenizer or model is read
    check_eval_memory(sources, spec.lengths, max(spec.lengths, default=1), dtype=spec.dtype)
    plan = Plan(lengths=list(spec.lengths), queries=spec.queries, seed=spec.seed)
    calibrate_tokens = spec.calibrate_tokens if any(get_norm(n).calibrated_by_default for n in spec.norms) else 0
    shared_tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer else None
    if spec.tokenizer and shared_tokenizer is None:
        raise RetrofitError(f"--tokenizer {spec.tokenizer}: no tokenizer found there")

    results, token_counts, started = [], {}, time.time()
    for i, source in enumerate(sources):
        label = labels[i] if labels else _label(source)
        found, token_counts[label] = _diagnose_source(spec, source, label, plan, calibrate_tokens,
                                                      shared_tokenizer)
        results += found
    results = json.loads(json.dumps(results))  # keys become strings, as in the file
    with output_folder(out, "--out") as out:  # one writer: the folder's lock for the writes below
        _write(out, results, spec, plan, token_counts, started)
    return out


def _write(out: Path, results: list, spec, plan, token_counts: dict, started: float) -> None:
    header = {"command": f"retrofit diagnose {spec.command}", "data": str(spec.data),
              "tokens": ", ".join(f"{k}: {v}" for k, v in token_counts.items()), "windows": spec.windows,
              "lengths": plan.lengths, "seconds": round(time.time() - started, 1), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    atomic_write_text(out / "diagnose.json", dump_json({"schema": SCHEMA, "header": header, "models": results}))
    write_report(results, out, header)
    print(f"wrote {out / 'report.md'}, {out / 'diagnose.json'} and the figures ({header['seconds']} s)",
          file=sys.stderr)


def dump_json(obj) -> str:
    """Indented JSON with every innermost list of numbers on one line (one line per layer's heads)."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: re.sub(r"\s+", "", m.group(0)), text)


def _calibration_rows(tokens: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The calibration tokens as (1, chunk) rows for retrofit.calibrate; none is a one-line error."""
    rows = [tokens[j:j + chunk][None] for j in range(0, len(tokens) - chunk + 1, chunk)]
    if not rows:
        raise RetrofitError("no calibration tokens: raise --calibrate-tokens or use a longer --data")
    return rows


def _brief(info):
    if not info:
        return None
    keep = ("norm", "options", "nope", "calibration")
    return {k: info[k] for k in keep if k in info}


def _headline(r: dict) -> str:
    """One line per model for the terminal: the numbers the paper reports."""
    s, Lmax = r["summary"], r["lengths"][-1]
    crit = s["distance"]["critical"][Lmax]

    def frac(name):
        return "-" if crit[name]["fraction"] is None else f"{crit[name]['fraction']:.3f} L"

    slope = s["gradient"]["by_eps"].get("0.001", {}).get("slope_small_T_max", math.nan)
    return (f"{r['label']}: entropy {s['vanishing'][Lmax]['entropy']:.2f} of log L {math.log(Lmax):.2f} at "
            f"L={Lmax}; critical N {frac('printed')} (printed E), {frac('exact')} (exact E); separability "
            f"plateau {s['separability']['plateau']:.2f}; 1/T slope {slope:.2f}")
