"""`retrofit patch SOURCE --norm NAME [options] --out DIR`: patch a model and save it.

    retrofit patch gpt2 --norm avnorm --out gpt2-avnorm
    retrofit patch ./smollm2.gguf --norm avnorm --calibration-text book.txt --check-text para.txt --out smol-avnorm
    retrofit patch ./smollm2.gguf --norm softmax --rope yarn:4 --out smol-yarn     # RoPE 8192 -> 32768 positions

SOURCE is a Hub id, a local folder or a .gguf file. Prints the PatchReport; with --check-text, the
model's loss on that text before and after patching. Without --out (or --push-to-hub) nothing is saved, so it
is refused unless --check-text asks for a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_folder
from . import add_dtype_flag, add_progress_flag, check_counts, check_out, check_text_files
from .patch_flags import OPTIONS, add_norm_flags, norm_flags

# option -> {type (None = a switch), norms, doc}: one flag per declared norm option (patch_flags.py: no norm imported)
NORM_FLAGS = norm_flags(OPTIONS)


def add_arguments(parser):
    parser.add_argument("source", help="Hub id, local model folder, or .gguf file")
    parser.add_argument("--norm", required=True,
                        help=f"{' | '.join(sorted(OPTIONS))} (see `retrofit norms`)")
    parser.add_argument("--nope", action="store_true", help="also remove positional information")
    parser.add_argument("--layers", metavar="SEL", default=None,
                        help="patch only these attention layers (0-based, model order): 16-29, 0,3, 0-29:4 or :4 "
                             "(every 4th), 16- (to the last); the others keep the original attention")
    parser.add_argument("--heads", metavar="SEL", default=None,
                        help="a per-head norm (`retrofit norms` marks them): act on these query heads only (same "
                             "syntax); the others keep the original attention")
    parser.add_argument("--rope", metavar="TYPE:FACTOR[,KEY=VALUE...]", default=None,
                        help="extend RoPE: yarn:4, dynamic:4, linear:4, llama3:8,low_freq_factor=1,high_freq_factor=4 "
                             "(KEY: any of the type's keys, original = original_max_position_embeddings)")
    parser.add_argument("--gate", metavar="KIND[:START[:INPUTS]]", default=None,
                        help="output gate: each head's output (head) or channel (element) times 2*START*sigmoid(W x + "
                             "b) from the layer input, W = b = 0 at start: head (the identity at start), head:0.5:12 "
                             "(the AVnorm post's, from 12 input channels)")
    add_norm_flags(parser, OPTIONS)
    parser.add_argument("--calibration-text", metavar="FILE",
                        help="text file to calibrate per-head gains on (AVNorm; psoftmax with --gain)")
    parser.add_argument("--calibrate", dest="calibration_text", help=argparse.SUPPRESS)  # its older name
    parser.add_argument("--calibrate-tokens", type=int, default=8192,
                        help="tokens of --calibration-text to use (default 8192)")
    parser.add_argument("--check-text", metavar="FILE",
                        help="print the loss on this text before and after patching (2 forwards of --check-tokens "
                             "tokens)")
    parser.add_argument("--check-tokens", type=int, default=512, help="tokens of --check-text to use (default 512)")
    parser.add_argument("--rank", action="store_true",
                        help="with --check-text: also rank the patched layers (and heads of a per-head norm) by cost "
                             "and suggest --layers / --heads: 2 forwards + 1 per patched layer + 1 per query head + "
                             "1 per suggestion (SmolLM2-135M, 30 layers x 9 heads: 43 forwards); the count and an "
                             "estimate are printed first")
    parser.add_argument("--rank-k", type=int, default=None, metavar="K",
                        help="with --check-text: rank (as --rank) and suggest the K cheapest (default: half)")
    parser.add_argument("--schedule-values", metavar="T,T,...", default=None,
                        help="with --check-text: the loss at these recovery-schedule positions (0 = the original "
                             "model, 1 = the norm) and the per-head spread, before any training")
    parser.add_argument("--schedule-start", type=float, default=None,
                        help="the knob at position 0 (default the norm's identity value; see recovery.schedule)")
    parser.add_argument("--schedule-end", type=float, default=None,
                        help="the knob at position 1 (default the patch's own value; an avnorm floor may end at 1 or "
                             "2); the losses printed are recovery.schedule.costs for shape: loss")
    parser.add_argument("--out", help="folder to save the patched model (and tokenizer) to; without it (and "
                                      "without --push-to-hub) only --check-text's measurement runs, nothing is saved")
    add_dtype_flag(parser)
    add_progress_flag(parser, "no progress bars (calibration, the ranking's forwards)")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="after saving, push to this Hub repository (OWNER/NAME); see `retrofit push`")


def _read_tokens(tokenizer, path: str, limit: int):
    from ..data.read import read_tokens

    if tokenizer is None:
        raise RetrofitError("this model ships no tokenizer, so text files cannot be used with it")
    ids = read_tokens(path, tokenizer, budget=limit, special=True)[:limit]  # reads as far as `limit` needs
    if ids.numel() < 2:
        raise RetrofitError(f"{path} has fewer than 2 tokens")
    return ids


def _positions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RetrofitError(f"--schedule-values must be numbers in [0, 1] separated by commas, got {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise RetrofitError(f"--schedule-values must be numbers in [0, 1] separated by commas, got {text!r}")
    return values


def _check_selection_range(args) -> None:
    """--layers / --heads against the counts the config names, before loading (retrofit.patch checks the range again
    against the attention modules; the syntax and the rules between flags are the PatchSpec's)."""
    if args.layers is None and args.heads is None:
        return
    from ..load import load_config
    from ..load.preflight import check_selection_counts

    try:  # the range, from the config: before loading the weights (a text-only config names both counts)
        config = load_config(args.source)
    except (RetrofitError, OSError, ValueError):
        return  # load() reports what is wrong with the source
    check_selection_counts(config, [(args.layers, "layers", "--layers"), (args.heads, "heads", "--heads")])


def save_atomically(model, tokenizer, out: str) -> None:
    """Write to a temporary sibling folder, then rename: a crash never leaves a half-written model."""
    with atomic_folder(out, "--out") as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def _check_args(args):
    """Every check that needs no model, in one place: (the patch, as a PatchSpec; the schedule positions)."""
    from ..hub import check_repo, find_token
    from ..load import check_finished, source_kind
    from ..load.preflight import check_source
    from ..norms import calibrated_norm_hints, get_norm
    from ..patch_spec import CLI, PatchSpec

    check_counts(args, positive=("calibrate_tokens", "check_tokens", "rank_k"))
    args.out = check_out(args.out, "--out")  # new or empty; `~` expanded, once
    check_text_files([args.calibration_text] if args.calibration_text else [], "--calibration-text")
    check_text_files([args.check_text] if args.check_text else [], "--check-text")
    options = {k: getattr(args, k) for k in NORM_FLAGS if getattr(args, k) is not None}
    spec = PatchSpec(args.norm, options, nope=args.nope, rope=args.rope, layers=args.layers, heads=args.heads,
                     gate=args.gate, names=CLI)  # a bad norm, option, rope, selection or gate fails before loading
    _check_selection_range(args)
    if args.calibration_text and not get_norm(spec.norm).calibrates(spec.norm_options):
        raise RetrofitError(f"--calibration-text sets per-head gains; it needs a norm that has them: "
                            f"{calibrated_norm_hints()}")
    positions = _positions(args.schedule_values) if args.schedule_values else None
    if positions and not args.check_text:
        raise RetrofitError("--schedule-values measures a loss: give the text with --check-text FILE")
    if (args.rank or args.rank_k is not None) and not args.check_text:
        raise RetrofitError("--rank ranks by the loss on a text: give it with --check-text FILE")
    check_finished(args.source)  # an unfinished run, a missing or damaged local source: the first error
    if source_kind(args.source) != "hub":  # (a Hub id is looked up when it loads, after the token check)
        check_source(args.source)
    if not (args.out or args.push_to_hub or args.check_text):
        raise RetrofitError("nothing would be saved: give --out DIR (or --push-to-hub REPO); without them only "
                            "--check-text FILE measures the patch, saving nothing")
    if args.push_to_hub:  # a bad repo id or a missing token fails before any loading
        check_repo(args.push_to_hub)
        find_token()
    return spec, positions


def _warn_uncalibrated(args, spec) -> None:
    """A norm whose uncalibrated start ruins a pretrained model (AVNorm's unit gains): say what it costs, measured."""
    from ..norms import get_norm

    cost = None if args.calibration_text else get_norm(spec.norm).uncalibrated_cost(spec.options)
    if cost:
        print(f"retrofit patch: warning: {cost}; add --calibration-text FILE", file=sys.stderr)


def run(args) -> int:
    from ..calibration import calibrate, text_rows
    from ..costs import text_loss
    from ..load import load, load_tokenizer
    from ..patching import patch, unpatch_parameter_free

    spec, positions = _check_args(args)
    model = load(args.source, task_head=False, dtype=args.dtype)
    needs_tokens = args.calibration_text or args.check_text
    tokenizer = load_tokenizer(args.source) if (needs_tokens or args.out or args.push_to_hub) else None
    check = _read_tokens(tokenizer, args.check_text, args.check_tokens) if args.check_text else None
    before = text_loss(model, check) if check is not None else None
    replaced = unpatch_parameter_free(model, args.source, args.nope)
    report = patch(model, spec)
    _warn_uncalibrated(args, spec)
    if args.calibration_text:
        ids = _read_tokens(tokenizer, args.calibration_text, args.calibrate_tokens)
        report.calibration = calibrate(model, text_rows(model, ids), progress=not args.no_progress)
    print(report)
    if replaced:
        print(replaced)
    if check is not None:
        _check(model, check, before, positions, args, spec)
    if args.out:
        save_atomically(model, tokenizer, args.out)
        print(f"saved to {args.out}  (load with retrofit.from_pretrained({args.out!r}))")
    if args.push_to_hub:
        _push(model, tokenizer, args)
    if not args.out:
        print("nothing saved (no --out): this run only measured" + (" and pushed" if args.push_to_hub else ""))
    return 0


def _check(model, check, before: float, positions, args, spec) -> None:
    """--check-text: the loss before and after, the schedule positions' losses, the ranking."""
    from ..costs import rank_and_suggest, text_loss
    from ..recovery.probe import describe_spread, head_spread, schedule_losses

    started = time.perf_counter()
    after = text_loss(model, check)
    forward_s = time.perf_counter() - started
    print(f"loss on {args.check_text} ({check.numel()} tokens): original {before:.4f}, "
          f"patched {after:.4f} (ppl {math.exp(min(after, 50)):.2f})")
    if after - before > RISE_NATS:
        print(next_step(args.source, spec, after - before, calibrated=bool(args.calibration_text)))
    if positions:
        rows = schedule_losses(model, check[None], positions, start=args.schedule_start, end=args.schedule_end)
        for t, value, loss in rows:
            print(f"  schedule position {t:g} ({args.norm} knob {value:g}): loss {loss:.4f} ({loss - before:+.4f})")
        even = [i / (len(positions) - 1) for i in range(len(positions))] if len(positions) > 1 else None
        if even and all(abs(a - b) < 1e-9 for a, b in zip(positions, even)):  # evenly spaced 0..1: usable
            print(f"  recovery.schedule.costs for shape: loss: [{', '.join(f'{c:.4f}' for _, _, c in rows)}]")
        print(describe_spread(head_spread(model, check[None])))
    if args.rank or args.rank_k is not None:
        rank_and_suggest(model, check[None], args.rank_k, progress=not args.no_progress, forward_s=forward_s,
                         say=functools.partial(print, flush=True))


# A rise in loss past which the patched model is not usable as it is: 0.5 nats multiplies the perplexity by 1.65 (the
# calibrated AVNorm start on SmolLM2 costs +0.68 and needs training; a recovered arm is within 0.05 of softmax).
RISE_NATS = 0.5
RECOVERY_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "llama-recovery.yaml"


def next_step(source: str, spec, rise: float, calibrated: bool) -> str:
    """One line after --check-text shows a rise over RISE_NATS (p-softmax p=2 on SmolLM2: +9.3 nats, issue 62): the
    recovery-training command, its overrides made from this patch so that the recipe loads as printed, starting at
    the norm's identity (recovery.schedule: p-softmax p 1, SSMax blend 0) where the norm has a scheduled option."""
    from ..norms import get_norm
    from ..recipe import PatchSection, load_yaml

    cls = get_norm(spec.norm)
    section_keys = {f.name for f in dataclasses.fields(PatchSection)}
    recipe_patch = load_yaml(RECOVERY_RECIPE.read_text(), str(RECOVERY_RECIPE)).get("patch") or {}
    ours = {o.name for o in cls.option_schema()}
    overrides = [f"model.source={source}", f"patch.norm={spec.norm}",
                 *(f"patch.{k}={v}" for k, v in spec.options.items()),
                 *(f"patch.{k}=null" for k in recipe_patch if k not in ours and k not in section_keys)]
    if not cls.calibrated_by_default:
        overrides.append("patch.calibrate_tokens=0")
    start = ""
    if cls.scheduled_option is not None and cls.schedule_identity is not None:
        overrides.append("recovery.schedule.steps=20")
        start = f", from the original model ({cls.scheduled_option} {cls.schedule_identity:g}) to the patch"
    first = "" if calibrated or not cls.calibrated_by_default else "add --calibration-text FILE, then "
    recipe = os.path.relpath(RECOVERY_RECIPE) if RECOVERY_RECIPE.is_relative_to(Path.cwd()) else RECOVERY_RECIPE
    return (f"next step: the patch costs {rise:+.2f} nats here (over {RISE_NATS}); {first}recover it by training"
            f"{start}: retrofit train {shlex.join([str(recipe), *overrides])}")


def _push(model, tokenizer, args) -> None:
    """Push the saved folder (or, without --out, a temporary one) with the card naming this command."""
    from ..hub import push
    from ..load import is_hub_id

    flags = [f"--{k.replace('_', '-')}" + ("" if getattr(args, k) is True else f" {getattr(args, k)}")
             for k in NORM_FLAGS if getattr(args, k) is not None]
    command = " ".join(["retrofit patch", Path(args.source).name if not is_hub_id(args.source) else args.source,
                        f"--norm {args.norm}", *(["--nope"] if args.nope else []),
                        *([f"--layers {args.layers}"] if args.layers else []),
                        *([f"--heads {args.heads}"] if args.heads else []),
                        *([f"--rope {args.rope}"] if args.rope else []),
                        *([f"--gate {args.gate}"] if args.gate else []), *flags,
                        *(["--calibration-text FILE"] if args.calibration_text else [])])
    with tempfile.TemporaryDirectory(prefix="retrofit-patch-") as tmp:
        folder = args.out or os.path.join(tmp, "model")
        if not args.out:
            save_atomically(model, tokenizer, folder)
        # a local base: its card's license
        url = push(folder, args.push_to_hub, base_model=args.source, command=command)
    print(f"pushed to https://huggingface.co/{args.push_to_hub} ({url})")
