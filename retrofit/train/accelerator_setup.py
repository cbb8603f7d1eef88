"""The processes a run trains on: the Accelerator (the engine the launch asks for, its precision), the gradient
accumulation its batch size needs, and the processes' end.

    accelerator = make_accelerator(recipe.train, run_dir)    # refused in one line when the launch cannot run
    steps = accumulation(recipe.train, accelerator.num_processes)
    end_processes(accelerator)                               # every process past its last collective, then down
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs

from ..errors import RetrofitError
from ..recipe import TrainSection
from . import engine, zero
from .runlog import JsonlTracker


def resolve_precision(precision: str, cpu: bool) -> str:
    """accelerate's mixed_precision value: auto = bf16 on a GPU that supports it, else fp32 ("no")."""
    on_gpu = torch.cuda.is_available() and not cpu
    if precision == "auto":
        return "bf16" if on_gpu and torch.cuda.is_bf16_supported() else "no"
    if precision == "fp16" and not on_gpu:
        raise RetrofitError("train.precision fp16 needs a GPU; use fp32 or bf16 on CPU")
    return {"fp32": "no"}.get(precision, precision)


def make_accelerator(train: TrainSection, run_dir, trackers=()):
    """An Accelerator that runs the engine the launch asks for (engine.py: honored or refused in one line, before any
    process group) and cannot silently run N independent copies.

    Under torchrun / `accelerate launch --multi_gpu` on a machine without CUDA, a plain Accelerator() ignores
    WORLD_SIZE and every process trains alone (measured; tests/train/test_fsdp.py trains 2 CPU processes through
    here); so cpu=True is forced there (gloo), and the process count accelerate sees must equal WORLD_SIZE. DeepSpeed
    is the exception: accelerate runs it only with cpu=False, so on CPU processes it gets cpu=False and a gloo group
    (DeepSpeed's CPU accelerator does the rest; zero.py).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    asked = engine.requested(os.environ, train)
    engine.check_compile(os.environ, train.compile)
    precision = engine.check_precision(os.environ, train.precision)
    gpu = torch.cuda.is_available() and not train.cpu
    plugin, handlers, parallelism = None, [], None
    if asked.engine == "deepspeed":
        data_parallel = world // train.sequence_parallel
        plugin = zero.make_plugin(asked.config, train, accumulation(train, data_parallel), data_parallel, cpu=not gpu)
        cpu, handlers = False, ([] if gpu else [InitProcessGroupKwargs(backend="gloo")])
        parallelism = zero.parallelism_config(train.sequence_parallel, world)  # ALST for train.sequence_parallel
    else:
        cpu = train.cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or (
            world > 1 and not torch.cuda.is_available())
    # Several runs in one process (tests, the experiment driver) each choose their own precision.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=cpu, mixed_precision=resolve_precision(precision, not gpu), project_dir=str(run_dir),
        log_with=[JsonlTracker(Path(run_dir) / "log.jsonl"), *trackers], deepspeed_plugin=plugin,
        kwargs_handlers=handlers, parallelism_config=parallelism, dynamo_backend="inductor" if train.compile else "no",
    )
    if accelerator.num_processes != world:
        raise RetrofitError(f"WORLD_SIZE is {world} but accelerate runs {accelerator.num_processes} process(es): "
                            "launch with torchrun --nproc_per_node N or "
                            "accelerate launch --multi_gpu --num_processes N")
    engine.check_ran(asked, engine.what_ran(accelerator, train))
    return accelerator


def accumulation(train: TrainSection, processes: int) -> int:
    per_step = train.micro_batch_size * processes
    if train.batch_size % per_step:
        raise RetrofitError(f"train.batch_size {train.batch_size} is not a multiple of micro_batch_size "
                            f"{train.micro_batch_size} x {processes} process(es); change one of them")
    return train.batch_size // per_step


EXIT_KEY = "retrofit/exit"  # on the rendezvous store: each process adds 1 when it ends a run


def end_processes(accelerator: Accelerator, timeout_s: float = 600.0) -> None:
    """End a run: finish the trackers, then take the process group down only once every process is past its last
    collective.

    accelerate's end_training destroys the group right after the final barrier. Under gloo a process can return from
    that barrier while its peer still waits for the barrier's last message; when the first then tears the group down,
    the peer waited forever (seen once in CI: two CPU processes, rank 0 finished, rank 1 never printed). So every
    process first counts itself in on the rendezvous store, which outlives the group, and waits for the others.
    """
    for tracker in accelerator.trackers:
        tracker.finish()
    if not torch.distributed.is_initialized():
        return
    if accelerator.num_processes > 1:
        store, n = torch.distributed.distributed_c10d._get_default_store(), accelerator.num_processes
        arrived = store.add(EXIT_KEY, 1)
        everyone = -(-arrived // n) * n  # this round is complete at the next multiple of n (runs in one group agree)
        deadline = time.monotonic() + timeout_s
        while store.add(EXIT_KEY, 0) < everyone:
            if time.monotonic() > deadline:
                raise RetrofitError(f"another process did not finish within {timeout_s:.0f} s of this one; "
                                    "see its log for the error")
            time.sleep(0.01)
    torch.distributed.destroy_process_group()
