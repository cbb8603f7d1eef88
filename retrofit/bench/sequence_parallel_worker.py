"""One measuring process of `retrofit bench train --sequence-parallel N` (retrofit/bench/sequence_parallel.py).

    python -m retrofit.bench.sequence_parallel_worker WORKDIR SETTINGS_JSON      # under torchrun for N > 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..io.atomic import atomic_write_text


def worker(args, workdir: Path) -> None:
    """One process of a measurement: bench train's retrofit loop, then this rank's peak memory and tokens/s."""
    import torch

    from ..memory import PeakMemory
    from .loops import run_retrofit
    from .train_memory import load_model
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, processes = int(os.environ.get("RANK", "0")), args.sequence_parallel
    knobs = {"gradient_checkpointing": args.gradient_checkpointing, "loss_chunk_tokens": args.loss_chunk_tokens,
             "fsdp": args.fsdp and processes > 1}
    if getattr(args, "engine", "retrofit") == "deepspeed" and processes > 1:  # ALST over ZeRO-3 (train/alst.py)
        knobs["deepspeed"] = str(workdir / "zero3.json")
    model = load_model({"model": args.model, "model_type": args.model_type, "norm": args.norm,  # in `start`
                        "random_init": args.random_init})
    rows = torch.randint(0, model.config.vocab_size, (args.batch * args.steps, args.seq_len),
                         generator=torch.Generator().manual_seed(0))  # the rows bench train uses
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cuda":  # this process's GPU, before the peak is reset on it (accelerate picks the same one)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with PeakMemory(device) as memory:  # from here: what training holds at its peak (FSDP2 frees the full weights)
        stamps = run_retrofit(args, rows, workdir / f"run-{processes}", model, **knobs)  # (step, time) at each log
    (first_step, first), (last_step, last) = stamps[0], stamps[-1]
    ran = json.loads((workdir / f"run-{processes}" / "result.json").read_text())["engine"]
    atomic_write_text(workdir / f"measure-{processes}-{rank}.json", json.dumps({"engine": ran,
        "rank": rank, "start_mb": memory.start_mb, "peak_mb": memory.peak_mb, "added_mb": memory.added_mb,
        "tokens_per_s": (last_step - first_step) * args.batch * args.seq_len / (last - first),
        "threads": torch.get_num_threads(), "method": memory.method}))


if __name__ == "__main__":
    worker(argparse.Namespace(**json.loads(sys.argv[2])), Path(sys.argv[1]))
