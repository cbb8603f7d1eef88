"""One module per CLI verb: `retrofit <verb>` is `retrofit/commands/<verb>.py`.

Each module provides `add_arguments(parser)` and `run(args) -> int`, parses the command line, calls one
library function and prints; no library module uses argparse (retrofit/cli.py maps verbs to modules).
"""
