"""Benchmarks that print a table and write JSON: `retrofit bench attention | train | eval` (commands/bench.py).

Each module is a small program: `add_arguments(parser)` for its own options and `run(args) -> int`.
They are imported only when asked for, so one benchmark's heavy imports never slow another.
"""
