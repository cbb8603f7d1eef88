"""`retrofit norms`: every norm, its options and its formula.

    retrofit norms                 # a table: each norm's options with their defaults, and its formula
    retrofit norms --json          # the same as JSON (what `retrofit patch` and recipes accept)
"""

from __future__ import annotations

import json


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from ..norms import describe_norms

    rows = describe_norms()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        print(f"{row['name']:<10} {row['summary']}" + ("  [per head: --heads applies]" if row["per_head"] else ""))
        print(f"{'':<10} {row['formula']}")
        for opt in row["options"]:
            print(f"{'':<12}{opt['name']:<10} default {opt['default']!s:<8} {opt['doc']}")
        print()
    print("any norm composes with --nope (remove position embeddings / make rotary the identity)")
    return 0
