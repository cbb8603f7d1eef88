"""`retrofit bench train`: tokens/s of retrofit's training loop vs Hugging Face Trainer, same everything.

    retrofit bench train                                     # small random GPT-2, CPU, fp32, both loops
    retrofit bench train --model-type llama --norm avnorm --batch 8 --seq-len 256 --precision bf16 --out b.json

Both loops train the same freshly initialized model (same seed, same config, optionally patched) on
the same random tokens, with the same batch, precision, fused AdamW (the Trainer default), warmup +
cosine and clipping, and no evaluation or checkpointing. Each logs every `--warmup` steps (a host sync in both);
tokens/s is measured from the first such log to the last, so start-up and the first steps are excluded. The
loops alternate `--repeats` times in this one process; the ratio compares medians (robust to a
neighbour's burst on a shared machine; the JSON also keeps every repeat, the best, and the load
average). Target: retrofit >= 1.0x Trainer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text
from . import train_memory
from .loops import SIZES, RandomTokens, bench_model, run_retrofit, run_trainer  # noqa: F401

LOOPS = ("retrofit", "hf-trainer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-type", default="gpt2", choices=sorted(SIZES), help="model built from a small config")
    parser.add_argument("--norm", default=None, help="patch both models with this norm first (default: unpatched)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --memory: 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=None, help="steps per loop and repeat (a multiple of --warmup; "
                        "default 12; --memory: 2)")
    parser.add_argument("--warmup", type=int, default=3, help="steps excluded from timing; also the log interval")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each loop; medians are compared")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even when a GPU is present")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice); "
                        "1 is steadier on a shared machine")
    parser.add_argument("--out", default="bench-train.json", help="where to write the JSON results")
    parser.add_argument("--sequence-parallel", type=int, default=1, help="N > 1: retrofit's loop alone, one process "
                        "vs N sharing each row: peak memory per process, tokens/s (bench/sequence_parallel.py)")
    parser.add_argument("--fsdp", action="store_true", help="--sequence-parallel: the N processes also shard weights, "
                        "gradients and AdamW state (train.fsdp)")
    parser.add_argument("--engine", default="retrofit", choices=["retrofit", "deepspeed"],
                        help="--sequence-parallel: retrofit's Ulysses (DDP, or FSDP2 with --fsdp), or DeepSpeed: ALST "
                             "sharing each row over ZeRO-3 (train.deepspeed), against the same one-process loop")

    parser.add_argument("--memory", action="store_true", help="peak memory instead: each loop and length in a fresh "
                        "process (retrofit/bench/train_memory.py); also writes a markdown table beside --out")
    train_memory.add_arguments(parser)


def _rows(args, vocab: int):
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (args.batch * args.steps, args.seq_len), generator=g)


def _tokens_per_s(stamps: list[tuple[int, float]], args) -> float:
    """Tokens per second between the first and the last log (step, time)."""
    if len(stamps) < 2:
        raise RetrofitError("bench train: too few timed steps; raise --steps to at least 2 x --warmup")
    (first_step, first), (last_step, last) = stamps[0], stamps[-1]
    return (last_step - first_step) * args.batch * args.seq_len / (last - first)


def run(args: argparse.Namespace) -> int:
    if args.memory:
        args.batch = args.batch or 1
        return train_memory.run(args)
    args.batch, args.steps = args.batch or 4, args.steps or 12
    if getattr(args, "fsdp", False) and args.sequence_parallel == 1:
        raise RetrofitError("--fsdp is measured with --sequence-parallel N > 1 (one process against N sharded)")
    if getattr(args, "engine", "retrofit") != "retrofit" and (args.sequence_parallel == 1 or args.fsdp):
        raise RetrofitError("--engine deepspeed is measured with --sequence-parallel N > 1 and without --fsdp "
                            "(ZeRO-3 already shards weights, gradients and AdamW state)")
    if args.sequence_parallel > 1:
        from .sequence_parallel import run as run_sequence_parallel
        return run_sequence_parallel(args)
    if args.steps % args.warmup or args.steps < 2 * args.warmup:
        raise RetrofitError("--steps must be a multiple of --warmup and at least 2 x --warmup")
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    vocab = SIZES[args.model_type]["vocab_size"]
    rows = _rows(args, vocab)
    measured = {loop: [] for loop in LOOPS}
    for repeat in range(args.repeats):
        for loop in LOOPS:
            with tempfile.TemporaryDirectory() as workdir:
                fn = run_retrofit if loop == "retrofit" else run_trainer
                measured[loop].append(_tokens_per_s(fn(args, rows, Path(workdir) / "run"), args))
            print(f"repeat {repeat + 1}/{args.repeats} {loop:10} {measured[loop][-1]:12,.0f} tokens/s", flush=True)
    import os
    import statistics
    median = {loop: statistics.median(v) for loop, v in measured.items()}
    ratio = median["retrofit"] / median["hf-trainer"]
    result = {
        "benchmark": "train", "device": device, "model_type": args.model_type, "sizes": SIZES[args.model_type],
        "norm": args.norm, "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
        "timed_steps": args.steps - args.warmup, "precision": args.precision, "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
        "loops": {loop: {"tokens_per_s_median": round(median[loop], 1), "tokens_per_s_best": round(max(v), 1),
                         "repeats": [round(x, 1) for x in v]} for loop, v in measured.items()},
        "ratio": round(ratio, 3), "target": 1.0, "meets_target": ratio >= 1.0,
    }
    print(f"\n| loop       | tokens/s median | best | all {args.repeats} repeats |")
    print("|------------|----------------:|-----:|---------------|")
    for loop, v in measured.items():
        print(f"| {loop:10} | {median[loop]:15,.0f} | {max(v):4,.0f} | {', '.join(f'{x:,.0f}' for x in v)} |")
    print(f"\nretrofit / Trainer = {ratio:.2f}x (medians; target >= 1.0x) — {args.model_type}"
          f"{' + ' + args.norm if args.norm else ''}, batch {args.batch} x {args.seq_len}, {args.precision}, {device}, "
          f"load average {result['load_average']:.1f} on {result['cpus']} CPUs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0
