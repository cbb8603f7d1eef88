"""Benchmarks that print a table and write JSON: `retrofit bench attention | train | eval | decode | gpu`
(commands/bench.py; gpu.py writes a folder: JSON + markdown).

Each module is a small program: `add_arguments(parser)` for its own options and `run(args) -> int`.
They are imported only when asked for, so one benchmark's heavy imports never slow another.
"""
