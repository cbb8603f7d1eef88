"""`retrofit eval MODEL... --data FILE --lengths 256,512,...,65536 --out DIR`: length extrapolation.

    retrofit eval runs/base runs/avnorm --data persuasion.txt --lengths 256,512,...,65536 \\
        --train-len 1024 --max-tokens 65536 --out eval/
    retrofit eval HuggingFaceTB/SmolLM2-135M --rope yarn:4 --data persuasion.txt --lengths 512,...,32768
    retrofit eval base.gguf --patch avnorm:kind=rms --rope dynamic:4 --data persuasion.txt   # training-free

    retrofit eval runs/x --tasks niah,vt,cwe --data book.txt --lengths 4096,...,32768 --samples 8 --depths 0,0.5,1
    retrofit eval --list-tasks                        # one line per task: what it is, how it is scored
    retrofit eval --export-harness ruler/ --tasks niah --lengths 4096 --tokenizer runs/x   # lm-eval local tasks
    retrofit eval --merge eval-16k/results.json eval-32k/results.json --reference a --out eval/  # pair, no re-scoring

--patch NORM[:KEY=VALUE,...] and --rope TYPE:FACTOR[,KEY=VALUE...] patch every model on the fly before it is
evaluated (--rope alone keeps softmax attention); a model already patched is kept if it carries that patch.
--variants FILE (a YAML list of {name, patch, rope, calibrate}) evaluates every model once per variant:
    - {name: original}
    - {name: yarn4, rope: "yarn:4"}
    - {name: yarn4+avnorm, rope: "yarn:4", patch: {norm: avnorm}, calibrate: {data: emma.txt, tokens: 8192}}
Parses the command line into an `EvalSpec` and calls `retrofit.evaluate.folder.evaluate_into` (evaluate_models, then
the report written into --out; --merge: merge_into; --export-harness: ruler_export.export_tasks), then prints the
tables and the files written.
"""

from __future__ import annotations

import argparse

from ..errors import RetrofitError
from . import (
    add_dtype_flag,
    add_patch_flag,
    add_progress_flag,
    check_counts,
    check_out,
    check_text_files,
    library_bars,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", help="run folders, patched checkpoints, Hub ids or .gguf files")
    parser.add_argument("--data", nargs="+", default=None,
                        help="text files (one document each) or .json files of token ids (lm task)")
    parser.add_argument("--lengths", default="256,512,...,4096",
                        help="context lengths: 256,512,1024 or a doubling 256,512,...,65536")
    parser.add_argument("--train-len", type=int, default=None, help="the training length, marked in tables and plots")
    parser.add_argument("--out", default="eval", help="folder for results.json/.csv/.md and the plots")
    parser.add_argument("--tasks", default=None,
                        help="comma list of lm, passkey, counting and the RULER tasks niah, niah_multikey, "
                             "niah_multivalue, niah_multiquery, vt, cwe, fwe (default: counting for counting runs, "
                             "else lm; --list-tasks says what each is)")
    parser.add_argument("--list-tasks", action="store_true", help="print one line per task and exit")
    parser.add_argument("--samples", type=int, default=8, help="RULER samples per length (and depth)")
    parser.add_argument("--needle", default="number", choices=["word", "number", "uuid"],
                        help="the kind of value the niah needles hold")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RULER instances")
    parser.add_argument("--export-harness", metavar="DIR", default=None,
                        help="write the RULER instances of --tasks at --lengths as lm-evaluation-harness local "
                             "tasks (YAML + JSONL) into DIR, and exit (needs --tokenizer, no models)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on scored tokens per length and model (default: every window)")
    parser.add_argument("--max-windows", type=int, default=None,
                        help="cap on windows per length and model, dealt across the --data documents (3 documents, "
                             "--max-windows 3: one from each at every length)")
    parser.add_argument("--names", default=None, help="comma-separated names for the models, in order")
    parser.add_argument("--reference", metavar="NAME[,NAME...]", default=None,
                        help="the model(s) the others are compared with on the same windows (paired differences with "
                             "95%% intervals, one table per reference); default the first model")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (or model) to use for every model")
    parser.add_argument("--batch-tokens", type=int, default=16384,
                        help="tokens per forward (windows batched up to this)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="positions per head/loss chunk")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                        help="passkey and niah depths, 0 = start .. 1 = end")
    parser.add_argument("--trials", type=int, default=8, help="passkey trials / counting sequences per length")
    parser.add_argument("--alphabet", type=int, default=None, help="counting alphabet (default: the run's recipe)")
    parser.add_argument("--prefixes", action="store_true",
                        help="counting: score every length as a prefix of sequences of the longest length (the L2 "
                             "post's evaluation: one forward at the longest length)")
    add_patch_flag(parser, "patch every model before evaluating it, e.g. avnorm:kind=rms or ssmax:scale=beyond; "
                           "avnorm:layers=16-29,heads=0+3 patches layers 16-29, heads 0 and 3 ('+' joins items)")
    parser.add_argument("--rope", metavar="TYPE:FACTOR[,KEY=VALUE...]", default=None,
                        help="extend every model's RoPE before evaluating it: yarn:4, dynamic:4, linear:4 "
                             "(with --patch, or alone: softmax attention)")
    parser.add_argument("--variants", metavar="FILE", default=None,
                        help="YAML list of {name, patch: {norm, ...options}, rope}: evaluate every model once per "
                             "variant, side by side (training-free settings in one report)")
    add_dtype_flag(parser)
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                        help="vllm: vLLM with retrofit's plugin answers the generation tasks (niah ... fwe) of saved "
                             "checkpoints (install: docs/serving.md)")
    add_progress_flag(parser)
    parser.add_argument("--merge", nargs="+", metavar="RESULTS", default=None,
                        help="no models: put finished results.json files side by side (a model in several gets all "
                             "its rows) and recompute the paired differences (--reference) into --out, re-scoring "
                             "nothing")


def run(args: argparse.Namespace) -> int:
    from ..bounds import MOST, check_size
    from ..evaluate.ruler_export import task_list

    if args.list_tasks:
        print(task_list())
        return 0
    check_counts(args, positive=("trials", "batch_tokens", "chunk_tokens", "max_tokens", "max_windows", "train_len",
                                 "alphabet", "samples"))
    for name in ("samples", "trials"):  # before anything is built: every one is kept in results.json
        check_size(getattr(args, name), f"--{name}", MOST[name])
    if args.max_windows is not None:
        check_size(args.max_windows, "--max-windows", MOST["windows"])
    if args.export_harness:
        return _export(args)
    if args.merge:
        return _merge(args)
    if not args.models:
        raise RetrofitError("retrofit eval needs at least one model (or --list-tasks, or --export-harness DIR)")
    return _run_models(args)


def _run_models(args: argparse.Namespace) -> int:
    """Score the models: every check first, then retrofit.evaluate.folder.evaluate_into makes --out and writes."""
    import torch

    from ..evaluate import EvalSpec
    from ..evaluate.folder import evaluate_into

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out = check_out(args.out, "--out", empty=False)  # results (made by retrofit) are rewritten in place
    check_text_files(args.data or [], "--data")
    depths = _depths(args.depths)
    variants = _read_variants(args.variants) if args.variants else None
    counting = {"sequences": args.trials, **({"alphabet": args.alphabet} if args.alphabet else {}),
                **({"prefixes": True} if args.prefixes else {})}
    spec = EvalSpec(
        data=args.data, lengths=args.lengths, train_len=args.train_len,
        tasks=args.tasks.split(",") if args.tasks else None, max_tokens=args.max_tokens, tokenizer=args.tokenizer,
        max_windows=args.max_windows,
        names=args.names.split(",") if args.names else None, reference=args.reference,
        batch_tokens=args.batch_tokens,
        chunk_tokens=args.chunk_tokens, dtype=args.dtype, device=args.device,
        passkey={"depths": depths, "trials": args.trials}, counting=counting, progress=not args.no_progress,
        patch=args.patch or None, rope=args.rope, variants=variants, engine=args.engine,
        ruler={"samples": args.samples, "depths": depths, "needle": args.needle, "seed": args.seed},
    )  # checked now: a bad setting fails before --out is made
    with library_bars(not args.no_progress):
        outcome = evaluate_into(args.models, spec, args.out)
    _print(outcome)
    return 0


def _merge(args) -> int:
    """--merge: finished evaluations as one report (retrofit.evaluate.folder.merge_into), nothing re-scored."""
    from ..evaluate.folder import merge_into

    if args.models:
        raise RetrofitError("--merge takes results.json files, not models: drop the models, or --merge")
    args.out = check_out(args.out, "--out", empty=False)
    _print(merge_into(args.merge, args.out, args.reference))
    return 0


def _export(args) -> int:
    """--export-harness: the RULER instances as lm-eval tasks (retrofit.evaluate.ruler_export.export_tasks)."""
    from ..evaluate.ruler_export import export_tasks

    options = {"samples": args.samples, "depths": _depths(args.depths), "needle": args.needle, "seed": args.seed}
    if args.models:
        raise RetrofitError("--export-harness writes tasks, it evaluates no model: drop the model arguments")
    names = export_tasks(args.export_harness, args.tokenizer, args.tasks.split(",") if args.tasks else None,
                         args.lengths, args.data, options)
    print(f"wrote {len(names)} lm-eval tasks into {args.export_harness}: {', '.join(names)}")
    return 0


def _print(outcome) -> None:
    """The tables, then the files written."""
    from ..evaluate.folder import result_tables

    tables = result_tables(outcome.results)
    if tables:
        print(tables)
    print("wrote " + ", ".join(str(p) for p in outcome.paths))


def _depths(text: str) -> list[float]:
    """--depths as numbers in [0, 1] (0 = start of the haystack, 1 = its end)."""
    from ..bounds import MOST, check_size

    check_size(text.count(",") + 1, f"--depths {text[:40]!r}: the number of depths", MOST["depths"])
    try:
        depths = [float(d) for d in text.split(",")]
    except ValueError:
        raise RetrofitError(f"--depths {text!r}: give numbers between 0 and 1, like 0,0.5,1") from None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise RetrofitError(f"--depths {text!r}: {bad[0]:g} is outside [0, 1]; give depths between 0 (start) and 1 "
                            "(end), like 0,0.5,1")
    return depths


def _read_variants(path: str) -> list[dict]:
    from ..evaluate import check_variants
    from ..recipe import read_yaml_file

    variants = read_yaml_file(path, "--variants", "a variants file is a short list of {name, patch, rope}")
    return check_variants(variants)
