"""`retrofit patch SOURCE --norm NAME [options] --out DIR`: patch a model and save it.

    retrofit patch gpt2 --norm avnorm --out gpt2-avnorm
    retrofit patch ./smollm2.gguf --norm avnorm --calibration-text book.txt --check-text para.txt --out smol-avnorm
    retrofit patch ./smollm2.gguf --norm softmax --rope yarn:4 --out smol-yarn     # RoPE 8192 -> 32768 positions

SOURCE is a Hub id, a local folder or a .gguf file. Prints the PatchReport; with --check-text, the
model's loss on that text before and after patching. Without --out (or --push-to-hub) nothing is saved, so it
is refused unless --check-text asks for a measurement.

The flags become a retrofit.patch_job.PatchJob (the checks that need no model first); run_patch_job does the rest,
and its lines are printed as they come.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from ..errors import RetrofitError
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


def _positions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RetrofitError(f"--schedule-values must be numbers in [0, 1] separated by commas, got {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise RetrofitError(f"--schedule-values must be numbers in [0, 1] separated by commas, got {text!r}")
    return values


def _job(args):
    """The command line as a PatchJob, after every check of it that needs no model (the others: check_job)."""
    from ..patch_job import PatchJob
    from ..patch_spec import CLI, PatchSpec

    check_counts(args, positive=("calibrate_tokens", "check_tokens", "rank_k"))
    args.out = check_out(args.out, "--out")  # new or empty; `~` expanded, once
    check_text_files([args.calibration_text] if args.calibration_text else [], "--calibration-text")
    check_text_files([args.check_text] if args.check_text else [], "--check-text")
    options = {k: getattr(args, k) for k in NORM_FLAGS if getattr(args, k) is not None}
    spec = PatchSpec(args.norm, options, nope=args.nope, rope=args.rope, layers=args.layers, heads=args.heads,
                     gate=args.gate, names=CLI)  # a bad norm, option, rope, selection or gate fails before loading
    return PatchJob(args.source, spec, calibration_text=args.calibration_text, calibrate_tokens=args.calibrate_tokens,
                    check_text=args.check_text, check_tokens=args.check_tokens, rank=args.rank, rank_k=args.rank_k,
                    schedule_values=_positions(args.schedule_values) if args.schedule_values else None,
                    schedule_start=args.schedule_start, schedule_end=args.schedule_end, out=args.out,
                    push_to_hub=args.push_to_hub, command=_card_command(args) if args.push_to_hub else None,
                    dtype=args.dtype, progress=not args.no_progress)


def run(args) -> int:
    from ..patch_job import run_patch_job

    outcome = run_patch_job(_job(args), say=functools.partial(print, flush=True),
                            warn=lambda line: print(f"retrofit patch: warning: {line}", file=sys.stderr))
    if outcome.pushed:
        print(f"pushed to https://huggingface.co/{args.push_to_hub} ({outcome.pushed})")
    if not args.out:
        print("nothing saved (no --out): this run only measured" + (" and pushed" if args.push_to_hub else ""))
    return 0


def _card_command(args) -> str:
    """The command line the pushed model card names: a local source by its name only, a text file as FILE."""
    from ..load import is_hub_id

    flags = [f"--{k.replace('_', '-')}" + ("" if getattr(args, k) is True else f" {getattr(args, k)}")
             for k in NORM_FLAGS if getattr(args, k) is not None]
    return " ".join(["retrofit patch", Path(args.source).name if not is_hub_id(args.source) else args.source,
                     f"--norm {args.norm}", *(["--nope"] if args.nope else []),
                     *([f"--layers {args.layers}"] if args.layers else []),
                     *([f"--heads {args.heads}"] if args.heads else []),
                     *([f"--rope {args.rope}"] if args.rope else []),
                     *([f"--gate {args.gate}"] if args.gate else []), *flags,
                     *(["--calibration-text FILE"] if args.calibration_text else [])])
