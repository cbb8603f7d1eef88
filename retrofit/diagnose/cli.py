"""`retrofit diagnose`: load each model (and, on request, a patched variant), read the text, run the measures.

    retrofit diagnose runs/demo/base runs/demo/avnorm ./smollm2.gguf \\
        --data ../shared/data/books/persuasion.txt --lengths 32,64,...,1024 --out diag/
    retrofit diagnose ./smollm2.gguf --patch avnorm --calibrate-tokens 8192 --data book.txt --out diag/
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from ..atomic import atomic_write_text
from ..errors import RetrofitError

DEFAULT_LENGTHS = "32,64,...,1024"
SCHEMA = "retrofit.diagnose/1"  # diagnose.json: {schema, header, models: [summary.summarize results]}


def parse_lengths(text: str) -> list[int]:
    """'32,64,128', or with an ellipsis 'a,b,...,z': doubling-style when z is in a, a*(b/a), ...
    ('32,64,...,1024'), else evenly spaced when z is in a, b, b+(b-a), ... ('100,200,...,500')."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = RetrofitError(f"--lengths {text!r}: give integers like 32,64,128 or 32,64,...,1024")
    try:
        if "..." not in parts:
            lengths = [int(p) for p in parts]
        else:
            i = parts.index("...")
            if i < 2 or i != len(parts) - 2:
                raise bad
            head, (a, b, end) = [int(p) for p in parts[: i - 2]], (int(parts[i - 2]), int(parts[i - 1]), int(parts[-1]))
            if a < 1 or b <= a or end < b:
                raise bad
            geometric = [a * (b // a) ** k for k in range(64) if a * (b // a) ** k <= end] if b % a == 0 else []
            if geometric and geometric[-1] == end:
                lengths = head + geometric
            elif (end - a) % (b - a) == 0:
                lengths = head + list(range(a, end + 1, b - a))
            else:
                raise bad
    except ValueError:
        raise bad from None
    if not lengths or min(lengths) < 2:
        raise RetrofitError(f"--lengths {text!r}: every length must be an integer >= 2")
    return sorted(set(lengths))


def parse_patch(text: str) -> tuple[str, dict]:
    """'avnorm' or 'psoftmax:p=2' or 'avnorm:kind=layer,affine=true' -> (norm, options)."""
    import yaml

    name, _, rest = text.partition(":")
    options = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise RetrofitError(f"--patch {text!r}: options are key=value, e.g. avnorm:kind=layer")
        options[key.strip()] = yaml.safe_load(value)
    return name.strip(), options


def add_arguments(parser) -> None:
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="model: Hub id, folder or .gguf file")
    parser.add_argument("--data", required=True, help="a plain-text file (long enough for the windows)")
    parser.add_argument("--out", required=True, help="output folder: diagnose.json, report.md, *.png")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"context lengths L (default {DEFAULT_LENGTHS})")
    parser.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: each model's own)")
    parser.add_argument("--windows", type=int, default=2, help="text windows of max(L) tokens (default 2)")
    parser.add_argument("--queries", type=int, default=8, help="query rows measured per length (default 8)")
    parser.add_argument("--patch", action="append", default=[], metavar="NORM[:k=v,...]",
                        help="also diagnose each source patched with this norm (repeatable), e.g. avnorm")
    parser.add_argument("--calibrate-tokens", type=int, default=8192,
                        help="tokens of --data (after the windows) that calibrate avnorm gains (default 8192; 0: none)")
    parser.add_argument("--label", action="append", default=[], help="a name per source, in order")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random directions of g(T, eps)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _label(source: str) -> str:
    p = Path(source.rstrip("/"))
    return p.stem if source.endswith(".gguf") else p.name or source


def _tokens(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _windows(tokens: torch.Tensor, count: int, length: int, reserve: int, data: str) -> tuple[torch.Tensor, torch.Tensor]:
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


def _variants(args, source, label, model):
    """(label, model, norm, patch info, patched here?) for the source itself and each --patch."""
    import retrofit

    record = retrofit.patch_record(model)
    yield label, model, (record or {}).get("norm"), record, False
    for spec in args.patch:
        name, options = parse_patch(spec)
        if record:
            raise RetrofitError(f"{source} is already patched with {record['norm']}; --patch applies to "
                                "unpatched sources only")
        variant = copy.deepcopy(model)  # deep-copies its config too: the original stays unpatched
        report = retrofit.patch(variant, name, **options)
        yield f"{label}+{name}", variant, name, report.as_dict(), True


def _diagnose_source(args, source: str, label: str, text: str, plan, calibrate_tokens: int, tokenizer):
    """Every result for one source: the model as it is, then each --patch variant. Returns (results, tokens)."""
    from retrofit.models import load_model, load_tokenizer, max_learned_positions

    from . import diagnose

    tokenizer = tokenizer or load_tokenizer(source)
    if tokenizer is None:
        raise RetrofitError(f"{source} has no tokenizer; pass --tokenizer (e.g. a folder with tokenizer.json)")
    tokens = _tokens(tokenizer, text)
    Lmax = plan.lengths[-1]
    windows, calib = _windows(tokens, args.windows, Lmax, calibrate_tokens, args.data)
    model = load_model(source, dtype=args.dtype)
    limit = max_learned_positions(model)
    if limit is not None and Lmax > limit:
        raise RetrofitError(f"{source} has learned positions for {limit} tokens only; use --lengths up to {limit}")
    if windows.max() >= model.get_input_embeddings().num_embeddings:
        raise RetrofitError(f"the tokenizer makes ids beyond {source}'s vocabulary: pass the model's own --tokenizer")
    results = []
    for name, variant, norm, info, fresh in _variants(args, source, label, model):
        if fresh and norm == "avnorm" and calibrate_tokens:  # a fresh AVNorm starts from calibrated gains
            chunk = min(Lmax, 512)
            batches = [calib[j:j + chunk][None] for j in range(0, len(calib) - chunk + 1, chunk)]
            info = {**info, "calibration": retrofit_calibrate(variant, batches, progress=not args.quiet)}
        result = diagnose(variant, windows, plan, label=name, progress=not args.quiet,
                          meta={"source": source, "norm": norm, "patch": _brief(info)})
        print(_headline(result), file=sys.stderr)
        results.append(result)
    return results, len(tokens)


def run(args) -> int:
    from retrofit.models import load_tokenizer
    from retrofit.norms import get_norm

    from .collect import Plan
    from .report import write_report

    if args.windows < 1 or args.queries < 1:
        raise RetrofitError("--windows and --queries must be >= 1")
    if args.label and len(args.label) != len(args.sources):
        raise RetrofitError(f"--label was given {len(args.label)} time(s) for {len(args.sources)} source(s)")
    patches = [parse_patch(spec)[0] for spec in args.patch]
    for name in patches:
        get_norm(name)  # an unknown norm fails now, not after loading a model
    if not Path(args.data).is_file():
        raise RetrofitError(f"--data {args.data}: no such file")
    text = Path(args.data).read_text(encoding="utf-8", errors="replace")
    plan = Plan(lengths=parse_lengths(args.lengths), queries=args.queries, seed=args.seed)
    calibrate_tokens = args.calibrate_tokens if "avnorm" in patches else 0
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.tokenizer and tokenizer is None:
        raise RetrofitError(f"--tokenizer {args.tokenizer}: no tokenizer found there")

    results, token_counts, started = [], {}, time.time()
    for i, source in enumerate(args.sources):
        label = args.label[i] if args.label else _label(source)
        found, token_counts[label] = _diagnose_source(args, source, label, text, plan, calibrate_tokens, tokenizer)
        results += found
    results = json.loads(json.dumps(results))  # keys become strings, as in the file
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["diagnose"] else "..."
    header = {"command": f"retrofit diagnose {command}", "data": str(args.data),
              "tokens": ", ".join(f"{k}: {v}" for k, v in token_counts.items()), "windows": args.windows,
              "lengths": plan.lengths, "seconds": round(time.time() - started, 1), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    atomic_write_text(out / "diagnose.json", dump_json({"schema": SCHEMA, "header": header, "models": results}))
    write_report(results, out, header)
    print(f"wrote {out / 'report.md'}, {out / 'diagnose.json'} and the figures ({header['seconds']} s)",
          file=sys.stderr)
    return 0


def dump_json(obj) -> str:
    """Indented JSON with every innermost list of numbers on one line (one line per layer's heads)."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: re.sub(r"\s+", "", m.group(0)), text)


def retrofit_calibrate(model, batches, progress: bool = True) -> dict:
    """AVNorm gains from text (retrofit.calibrate), with a progress bar."""
    import retrofit
    from tqdm.auto import tqdm

    if not batches:
        raise RetrofitError("no calibration tokens: raise --calibrate-tokens or use a longer --data")
    return retrofit.calibrate(model, tqdm(batches, desc="calibrate avnorm", unit="batch", disable=not progress,
                                          leave=False))


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
