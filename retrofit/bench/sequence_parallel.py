"""`retrofit bench train --sequence-parallel N`: peak memory per process and tokens/s of retrofit's training loop,
one process against N processes sharing each row (train.sequence_parallel, Ulysses), at the same length.

    retrofit bench train --sequence-parallel 2 --model-type llama --batch 1 --seq-len 4096 --steps 4 --warmup 2
    retrofit bench train --sequence-parallel 2 --engine deepspeed ...     # DeepSpeed's ALST over ZeRO-3 instead

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
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text
from .loops import SIZES

TARGET = 0.6
# --engine deepspeed's config: ZeRO-3 with the buffer sizes accelerate derives from the model's width ("auto": hidden^2
# elements per reduce and prefetch bucket, 10 x hidden for parameters kept whole) and every gathered parameter
# released after its use (max live 0, no reuse distance): DeepSpeed's least memory. Measured on SmolLM2's sizes with
# 8 heads, 4,608 tokens, 2 processes: 0.77x one process with DeepSpeed's defaults (a 500M-element reduce bucket),
# 0.70x with the "auto" buckets, 0.68x with both
ZERO3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
                               "stage3_max_reuse_distance": 0}}


def _measure(args, workdir: Path, processes: int) -> list[dict]:
    """Launch one measurement (a plain process, or torchrun with N) and read back every rank's numbers."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    (workdir / "zero3.json").write_text(json.dumps(ZERO3))  # --engine deepspeed
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


def _heads(args) -> int:
    """The model's query heads, from its config alone."""
    if args.model:
        from ..load import load_config
        return load_config(args.model).num_attention_heads
    sizes = SIZES[args.model_type]
    return sizes.get("num_attention_heads") or sizes["n_head"]


def run(args: argparse.Namespace) -> int:
    n = args.sequence_parallel
    if args.steps % args.warmup or args.steps < 2 * args.warmup:
        raise RetrofitError("--steps must be a multiple of --warmup and at least 2 x --warmup")
    if args.seq_len % n:
        raise RetrofitError(f"--seq-len {args.seq_len} is not a multiple of --sequence-parallel {n}")
    heads = _heads(args)
    if heads % n:  # Ulysses gives each process whole heads: refuse now, not after the one-process run
        raise RetrofitError(f"the model's {heads} attention heads cannot be split over --sequence-parallel {n}: "
                            f"choose a divisor of {heads}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        one, many = _measure(args, Path(tmp), 1), _measure(args, Path(tmp), n)
    peak_one, peak_many = one[0]["peak_mb"], max(r["peak_mb"] for r in many)
    ratio = peak_many / peak_one
    result = {
        "benchmark": "train-sequence-parallel", "command": " ".join(["retrofit", *sys.argv[1:]]),
        "model": args.model or args.model_type, "random_init": args.random_init, "norm": args.norm,
        "batch": args.batch, "seq_len": args.seq_len,
        "steps": args.steps, "precision": args.precision, "sequence_parallel": n, "fsdp": args.fsdp,
        "engine": many[0]["engine"],
        "gradient_checkpointing": args.gradient_checkpointing, "loss_chunk_tokens": args.loss_chunk_tokens,
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "memory_method": one[0]["method"],
        "one_process": one[0], "processes": many, "peak_ratio": round(ratio, 3),
        "added_ratio": round(max(r["added_mb"] for r in many) / one[0]["added_mb"], 3),
        "target": TARGET, "meets_target": ratio <= TARGET, "wall_s": round(time.perf_counter() - started, 1)}
    table = _table(result, one, many)
    print("\n" + table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    atomic_write_text(Path(args.out).with_suffix(".md"), table + "\n")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    return 0


def _table(result: dict, one: list[dict], many: list[dict]) -> str:
    """The markdown table and its one-line verdict (tokens/s: per the first rank, on whatever CPU was free)."""
    n = result["sequence_parallel"]
    deepspeed = result["engine"]["name"] == "deepspeed"
    sharded = " + FSDP2" if result["fsdp"] else " (DeepSpeed ALST + ZeRO-3)" if deepspeed else ""
    lines = ["| processes | peak MiB / process | at start | added by training | tokens/s | threads each |",
             "|----------:|-------------------:|---------:|------------------:|---------:|-------------:|"]
    for count, ranks in ((1, one), (n, many)):
        worst = max(ranks, key=lambda r: r["peak_mb"])
        lines.append(f"| {count}{sharded if count > 1 else ''} | {worst['peak_mb']:,.0f} | {worst['start_mb']:,.0f} | "
                     f"{worst['added_mb']:,.0f} | {ranks[0]['tokens_per_s']:,.0f} | {worst['threads']} |")
    lines.append(f"\npeak per process, {n} processes{sharded} / 1 = {result['peak_ratio']:.2f}x (target <= {TARGET}x); "
                 f"added by training {result['added_ratio']:.2f}x — {result['model']}"
                 f"{' + ' + result['norm'] if result['norm'] else ''}, batch {result['batch']} x {result['seq_len']}, "
                 f"{result['precision']}{', gradient checkpointing' if result['gradient_checkpointing'] else ''}, "
                 f"loss chunk {result['loss_chunk_tokens']}, load average {result['load_average']:.1f} on "
                 f"{result['cpus']} CPUs, {result['wall_s']:,.0f} s")
    return "\n".join(lines)
