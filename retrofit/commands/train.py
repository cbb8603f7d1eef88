"""`retrofit train RECIPE [section.key=value ...] [--out DIR] [--resume RUN_DIR]`.

    retrofit train recipes/train-tiny-counting.yaml
    retrofit train recipes/demo.yaml train.steps=200 patch.norm=psoftmax patch.p=2
    accelerate launch -m retrofit train recipes/gpt2-avnorm-retrofit.yaml   # DDP / FSDP / DeepSpeed
    deepspeed --num_gpus 8 --module retrofit train RECIPE train.deepspeed=ds.json  # DeepSpeed's own launcher
    retrofit train RECIPE --resume runs/x                                   # continue where it stopped
    retrofit train --resume runs/x train.steps=30                           # its own recipe, extended to 30 steps
    retrofit train RECIPE data.seq_len=16384 --dry-run [--plan-for cuda:80]  # predicted peak memory; fits?
    retrofit train --keys                                                   # every recipe key, default, meaning
"""

from __future__ import annotations

import argparse
import os

from ..errors import RetrofitError
from . import add_progress_flag, check_out, library_bars


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override recipe fields, e.g. train.steps=200 patch.norm=psoftmax patch.p=2")
    parser.add_argument("--out", help="run folder (overrides output.dir)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest complete checkpoint")
    parser.add_argument("--dry-run", action="store_true",
                        help="predict the run's peak memory (retrofit/train/dry_run.py), say whether it fits, and exit")
    parser.add_argument("--plan-for", metavar="DEVICE[:GiB]",
                        help="with --dry-run: plan for cpu:24, cuda:80 ... instead of this machine")
    parser.add_argument("--keys", action="store_true",
                        help="list every recipe key with its default and meaning, then exit")
    parser.add_argument("--markdown", action="store_true",
                        help="with --keys: as the markdown table of docs/reference/recipe.md")
    add_progress_flag(parser, "no progress bar (train.progress=false): for logs and files")
    parser.epilog = "Overrides go before the options: retrofit train RECIPE train.steps=10 --out runs/x"


def run(args: argparse.Namespace) -> int:
    # no torch: a recipe error comes first
    from ..recipe import documentation, documentation_markdown, load_recipe, resumed_recipe

    if args.keys and args.markdown:
        print(documentation_markdown())
        return 0
    if args.keys:
        for key, default, doc in documentation():
            print(f"{key:32} {default:14} {doc}")
        return 0
    args.recipe, args.overrides = resumed_recipe(args.recipe, args.overrides, args.resume)
    if args.recipe is None:
        raise RetrofitError("name a recipe: retrofit train RECIPE [section.key=value ...] (see recipes/)")
    overrides = list(args.overrides) + (["train.progress=false"] if args.no_progress else [])
    if args.out and args.resume:
        raise RetrofitError("pass either --out or --resume (which names the run folder), not both")
    # a run folder may exist (made by retrofit): training resumes or refuses it; `~` expanded here, once
    args.out = check_out(args.out, "--out", empty=False)
    args.resume = check_out(args.resume, "--resume", empty=False)
    recipe = load_recipe(args.recipe, overrides)
    if args.out or args.resume:  # the folder as typed: never handed to the YAML override parser ("run #2", null)
        recipe.output.dir = args.out or args.resume
    elif recipe.output.dir:  # the recipe's own (or overridden) output.dir, `~` expanded here
        recipe.output.dir = check_out(recipe.output.dir, "output.dir", empty=False)
    if args.dry_run:
        from ..train.dry_run import describe, plan_recipe
        print(describe(plan_recipe(recipe, args.plan_for)))
        return 0
    if args.plan_for:
        raise RetrofitError("--plan-for goes with --dry-run")
    from ..train import train

    with library_bars(not args.no_progress):  # --no-progress: transformers' "Writing model shards" bars too
        result = train(recipe, resume=bool(args.resume))  # checks the recipe first: data, source, memory
    last = result.losses.get(max(result.losses)) if result.losses else None
    if os.environ.get("RANK", "0") == "0":  # under accelerate launch / torchrun: once, not once per process
        print(f"done: {result.steps} steps" + (f", final loss {last:.4g}" if last is not None else "")
              + f"; model in {result.run_dir}")
    return 0
