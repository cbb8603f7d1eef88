"""`retrofit push SOURCE --repo OWNER/NAME`: publish a patched checkpoint, a training run or an adapter.

    retrofit push runs/llama-avnorm --repo me/smollm2-avnorm [--private] [--revision main]
    retrofit push runs/llama-avnorm --repo me/smollm2-avnorm --dry-run staged/   # write it, upload nothing
    retrofit push runs/llama-avnorm --repo me/smollm2-avnorm --standalone    # + trust_remote_code modeling file

Parses the command line and calls `retrofit.hub.push` (what goes up, and how: retrofit/hub/publish.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import add_progress_flag, check_out


def add_arguments(parser) -> None:
    parser.add_argument("source", help="a run folder (retrofit train), a patched checkpoint or an adapter folder")
    parser.add_argument("--repo", required=True, help="Hub repository OWNER/NAME (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing; default main)")
    parser.add_argument("--merged", action="store_true", help="LoRA runs: push the merged model, not the adapter")
    parser.add_argument("--base-model", default=None, help="Hub id of the base model (for the card and adapters)")
    parser.add_argument("--license", default=None, help="license for the card (default: the base model's, when known)")
    parser.add_argument("--eval", dest="eval_dir", default=None, help="folder written by `retrofit eval --out`")
    parser.add_argument("--standalone", action="store_true",
                        help="add a modeling file, generated from retrofit's code, that plain transformers loads with "
                             "trust_remote_code=True (no retrofit needed)")
    parser.add_argument("--dry-run", metavar="DIR", default=None,
                        help="write the folder that would be uploaded, upload nothing")
    add_progress_flag(parser, "no progress bars (staging the folder, the upload)")


@contextlib.contextmanager
def hub_progress(show: bool):
    """huggingface_hub's progress bars (the upload's) off inside the block unless `show`; as they were, after."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_off:
            enable_progress_bars()


def run(args) -> int:
    from ..hub import push

    args.dry_run = check_out(args.dry_run, "--dry-run")  # new or empty; `~` expanded, once
    with hub_progress(not args.no_progress):
        where = push(args.source, args.repo, private=args.private, revision=args.revision, merged=args.merged,
                     base_model=args.base_model, license=args.license, eval_dir=args.eval_dir, dry_run=args.dry_run,
                     progress=not args.no_progress, standalone=args.standalone)
    if args.dry_run:
        files = sorted(p for p in Path(where).rglob("*") if p.is_file())
        for p in files:
            print(f"{p.stat().st_size:>12,}  {p.relative_to(where)}")
        print(f"wrote {where} ({len(files)} files); nothing was uploaded (would go to {args.repo})")
    else:
        print(f"pushed {args.source} to https://huggingface.co/{args.repo} ({where})")
    return 0
