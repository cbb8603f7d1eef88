"""`retrofit bench train --sequence-parallel N`: peak memory per process and tokens/s of retrofit's training loop,
one process against N processes sharing each row (train.sequence_parallel, Ulysses), at the same length.

    retrofit bench train --sequence-parallel 2 --model-type llama --batch 1 --seq-len 4096 --steps 4 --warmup 2

Both runs train the same freshly built model (bench train's sizes, optionally patched) on the same random rows
with the same recipe: one plain process, then `torch.distributed.run --nproc_per_node N`, each process running
bench/sequence_parallel_worker.py (a separate module: it imports bench.loops, the loops bench.train runs). Each measures
its resident-memory high-water mark over the whole training call (retrofit.memory.PeakMemory: weights and
libraries are in `start`, what training adds is `added`) and the run's tokens/s between its first and last log.
Target: the N-process peak per process <= 0.6x the one-process peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..atomic import atomic_write_text
from ..errors import RetrofitError

TARGET = 0.6


def _measure(args, workdir: Path, processes: int) -> list[dict]:
    """Launch one measurement (a plain process, or torchrun with N) and read back every rank's numbers."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    settings = json.dumps({**vars(args), "sequence_parallel": processes})
    me = [sys.executable, "-m", "retrofit.bench.sequence_parallel_worker", str(workdir), settings]
    if processes > 1:
        me = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
              "-m", *me[2:]]
    proc = subprocess.run(me, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RetrofitError(f"bench train --sequence-parallel: the {processes}-process run failed: "
                            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return [json.loads((workdir / f"measure-{processes}-{r}.json").read_text()) for r in range(processes)]


def run(args: argparse.Namespace) -> int:
    n = args.sequence_parallel
    if args.steps % args.warmup or args.steps < 2 * args.warmup:
        raise RetrofitError("--steps must be a multiple of --warmup and at least 2 x --warmup")
    if args.seq_len % n:
        raise RetrofitError(f"--seq-len {args.seq_len} is not a multiple of --sequence-parallel {n}")
    with tempfile.TemporaryDirectory() as tmp:
        one, many = _measure(args, Path(tmp), 1), _measure(args, Path(tmp), n)
    peak_one, peak_many = one[0]["peak_mb"], max(r["peak_mb"] for r in many)
    ratio = peak_many / peak_one
    result = {
        "benchmark": "train-sequence-parallel", "model_type": args.model_type, "norm": args.norm, "batch": args.batch,
        "seq_len": args.seq_len, "steps": args.steps, "precision": args.precision, "sequence_parallel": n,
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "memory_method": one[0]["method"],
        "one_process": one[0], "processes": many, "peak_ratio": round(ratio, 3),
        "added_ratio": round(max(r["added_mb"] for r in many) / one[0]["added_mb"], 3),
        "target": TARGET, "meets_target": ratio <= TARGET}
    print("\n| processes | peak MiB / process | at start | added by training | tokens/s | threads each |")
    print("|----------:|-------------------:|---------:|------------------:|---------:|-------------:|")
    for count, ranks in ((1, one), (n, many)):
        worst = max(ranks, key=lambda r: r["peak_mb"])
        print(f"| {count:9} | {worst['peak_mb']:18,.0f} | {worst['start_mb']:8,.0f} | {worst['added_mb']:17,.0f} | "
              f"{ranks[0]['tokens_per_s']:8,.0f} | {worst['threads']:12} |")
    print(f"\npeak per process, {n} processes / 1 = {ratio:.2f}x (target <= {TARGET}x); added by training "
          f"{result['added_ratio']:.2f}x — {args.model_type}{' + ' + args.norm if args.norm else ''}, batch "
          f"{args.batch} x {args.seq_len}, {args.precision}, load average {result['load_average']:.1f} on "
          f"{result['cpus']} CPUs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0
