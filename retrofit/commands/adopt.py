"""`retrofit adopt DIR`: make a folder retrofit's because you say it is (a run written before the marker existed).

    retrofit adopt runs/old-run        # lists what is in it, then writes .retrofit-owned into it

Retrofit writes only into a folder that is new, empty, or holds its marker `.retrofit-owned`; it never guesses
from a folder's files (a copied results.json among your notes is not a run). A run from an older retrofit has no
marker: after you look at what adopt lists, retrofit may resume, rewrite and delete what it made there.
"""

from __future__ import annotations

import argparse

from ..errors import one_line
from ..io.atomic import MARKER, adopt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a folder retrofit wrote before it marked its folders (an older run)")


def run(args: argparse.Namespace) -> int:
    folder, listing = adopt(args.folder)
    print(f"{folder} holds {len(listing)}{'+' if len(listing) == 1000 else ''} entries:")
    for name, size in listing:  # a file's name may hold a newline or an escape sequence: shown escaped
        print(f"  {one_line(name)}" + (f"  ({size:,} bytes)" if not name.endswith("/") else ""))
    print(f"wrote {folder / MARKER}: retrofit may now write into {folder} (resume, rewrite its results) and delete "
          f"what it made there; remove {MARKER} to take it back")
    return 0
