"""`retrofit info PATH`: what a model folder, run, adapter, .gguf file or Hub id is, read without loading weights.

    retrofit info runs/avnorm
    retrofit info runs/avnorm --json

Prints `retrofit.info(PATH)` (retrofit/load/info.py): base, norm, options, layers/heads, rope, dtype, the
parameters the patch added and whether they moved from their initial values (calibrated or trained).
"""

from __future__ import annotations

import json


def add_arguments(parser) -> None:
    parser.add_argument("source", help="a model folder, run folder, adapter folder, .gguf file or Hub id")
    parser.add_argument("--json", action="store_true", help="print JSON instead of `key: value` lines")


def run(args) -> int:
    from ..load.info import describe, info
    from ..load.preflight import check_source

    check_source(args.source)  # an unfinished run, a damaged config: one line
    facts = info(args.source)
    print(json.dumps(facts, indent=2, default=str) if args.json else describe(facts))
    return 0
