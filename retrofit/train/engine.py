"""Which engine trains a run: what the launcher and its config ask for, refused in one line when retrofit cannot
run it, and a record of what did run (result.json's "engine", log.jsonl's first line).

    asked = requested(os.environ, recipe.train)   # before any process group: refuses, naming the setting
    accelerator = make_accelerator(...)            # accelerator_setup.py: runs what was asked (DeepSpeed on CPU too)
    engine = what_ran(accelerator, recipe.train)   # Engine(name="deepspeed", stage=3, world=2, backend="gloo")

Why: accelerate turns DeepSpeed and FSDP off for CPU processes (its state.py gates them on `not cpu`), and retrofit
forces cpu=True under several CPU processes, so an `accelerate launch --config_file ds_zero3.yaml` used to train plain
DDP, exit 0, with nothing saying so. Now every request is honored or refused (exit 2, one line):

    asked by                                       engine                  on CPU processes
    nothing, torchrun, accelerate --multi_gpu      one process / DDP       DDP over gloo
    train.fsdp: true                               FSDP2 (retrofit's)      yes
    accelerate config: DeepSpeed (ZeRO 0-3)        DeepSpeed               yes (gloo; retrofit/train/zero.py)
    train.deepspeed: ds_config.json                DeepSpeed               yes (any launcher, `deepspeed` too)
    accelerate config: FSDP                        accelerate's FSDP       refused: needs GPUs; train.fsdp instead
    accelerate config: Megatron-LM, TP, CP         -                       refused
    accelerate config: sp_size N with DeepSpeed    DeepSpeed's ALST        yes, when train.sequence_parallel is N
    the `deepspeed` launcher without a config      -                       refused: name train.deepspeed

The table per launcher and what each cell's test is: docs/many-gpus.md, tests/train/test_engines.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import RetrofitError

ON = ("1", "true", "yes")


@dataclass(frozen=True)
class Asked:
    """What the launch asks for: `engine` is "deepspeed", "fsdp" (accelerate's plugin) or None (DDP / one
    process); `config` is a DeepSpeed JSON config named by the recipe (train.deepspeed), else None."""

    engine: str | None
    config: str | None = None


def _flag(env, name: str) -> bool:
    return env.get(name, "").lower() in ON


def deepspeed_launcher(env) -> bool:
    """Started by DeepSpeed's own launcher (`deepspeed --module retrofit train ...`), which sets these and no
    torchrun or accelerate variable."""
    return "CROSS_SIZE" in env and "LOCAL_SIZE" in env and "TORCHELASTIC_RUN_ID" not in env


def requested(env, train) -> Asked:
    """What `env` (the launcher's environment) and the recipe's train section ask for; a one-line RetrofitError for
    what retrofit does not run, before any process group exists (every process refuses alike, none waits)."""
    for name, what in (("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM"), ("ACCELERATE_USE_TP", "tensor parallelism")):
        if _flag(env, name):
            raise RetrofitError(f"the accelerate config asks for {what}, which retrofit's loop does not run: launch "
                                "with a DDP, FSDP or DeepSpeed config")
    _check_parallelism_config(env, train, _flag(env, "ACCELERATE_USE_DEEPSPEED") or bool(train.deepspeed))
    world, size = int(env.get("WORLD_SIZE", "1") or 1), train.sequence_parallel
    if world % size:  # else world // size data-parallel replicas is 0 (a ZeroDivisionError sizing the batch)
        raise RetrofitError(f"train.sequence_parallel {size} does not divide the {world} process(es): launch a "
                            f"multiple of {size} processes, or set train.sequence_parallel (and sp_size) to a divisor")
    from_accelerate = _flag(env, "ACCELERATE_USE_DEEPSPEED")
    if train.deepspeed and from_accelerate:
        raise RetrofitError("DeepSpeed is configured twice: by the accelerate config and by train.deepspeed; keep one "
                            "(launch with torchrun or `deepspeed`, or drop train.deepspeed)")
    if from_accelerate or train.deepspeed:
        if train.fsdp:
            raise RetrofitError("train.fsdp shards the model itself and DeepSpeed is configured too: set train.fsdp "
                                "false or launch without DeepSpeed")
        if train.deepspeed and "LOCAL_RANK" not in env:
            raise RetrofitError("train.deepspeed needs a launcher that starts the processes: torchrun "
                                "--nproc_per_node N -m retrofit train ..., or deepspeed --module retrofit train ...")
        if train.cpu and torch.cuda.is_available():
            raise RetrofitError("train.cpu with DeepSpeed: DeepSpeed picks its device itself (DS_ACCELERATOR=cpu "
                                "runs it on the CPU); drop train.cpu")
        return Asked("deepspeed", train.deepspeed)
    if deepspeed_launcher(env):
        raise RetrofitError("the deepspeed launcher started this run but no DeepSpeed config is named: set "
                            "train.deepspeed: ds_config.json (or launch with torchrun for DDP)")
    if _flag(env, "ACCELERATE_USE_FSDP"):
        if train.fsdp:
            raise RetrofitError("train.fsdp shards the model itself; the accelerate config asks for FSDP too: set "
                                "train.fsdp false or launch without accelerate's FSDP config")
        if not torch.cuda.is_available() or train.cpu:
            raise RetrofitError("accelerate's FSDP config needs GPUs (accelerate turns FSDP off on CPU processes): on "
                                "CPU set train.fsdp: true and launch without the FSDP config")
        return Asked("fsdp")
    return Asked(None)


def _check_parallelism_config(env, train, deepspeed: bool) -> None:
    """accelerate's parallelism_config (PARALLELISM_CONFIG_* from its launcher): its sp_size under DeepSpeed is
    DeepSpeed's ALST, which train.sequence_parallel runs (they must agree); no other dimension is run."""
    if not _flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return
    sizes = {dim: int(env.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1") or 1)
             for dim in ("tp", "cp", "sp", "dp_shard", "dp_replicate")}
    used = [f"{dim}_size {n}" for dim, n in sizes.items() if n > 1 and dim != "sp"]
    if used:
        raise RetrofitError(f"the accelerate config's parallelism_config asks for {', '.join(used)}, which "
                            "retrofit's loop does not run: remove it from the config")
    sp = sizes["sp"]
    if sp > 1 and (not deepspeed or sp != train.sequence_parallel):
        raise RetrofitError(f"the accelerate config's parallelism_config asks for sp_size {sp}: set "
                            f"train.sequence_parallel: {sp} (under DeepSpeed it runs ALST; without, retrofit's own "
                            "Ulysses) and drop sp_size from the config unless DeepSpeed is configured")


def check_precision(env, precision: str) -> str:
    """The recipe's train.precision, or the launcher's when the recipe says auto; refused when both are explicit
    and differ (accelerate launch always sets ACCELERATE_MIXED_PRECISION, "no" by default, so only a non-"no"
    value is taken as asked)."""
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launcher in ("", "no"):
        return precision
    if launcher not in ("bf16", "fp16") or precision not in ("auto", launcher):
        raise RetrofitError(f"the launcher asks for mixed precision {launcher} but train.precision is {precision}: "
                            "make them agree (train.precision bf16/fp16/fp32, or the config's mixed_precision)")
    return launcher


def check_compile(env, compile_: bool, launcher_args: list[str] | None = None) -> None:
    """accelerate's dynamo_config (ACCELERATE_DYNAMO_BACKEND) is train.compile's: refused unless they agree. Under
    accelerate's DeepSpeed config the launcher passes no ACCELERATE_DYNAMO_* to its workers, so the config it read
    is read here (launcher_dynamo); retrofit does not compile under DeepSpeed, so any backend is refused."""
    if _flag(env, "ACCELERATE_USE_DEEPSPEED") and "ACCELERATE_DYNAMO_BACKEND" not in env:
        backend = launcher_dynamo(launcher_args)
        if backend not in (None, "", "no"):
            raise RetrofitError(f"the accelerate config asks for torch.compile (dynamo_backend {backend}), which its "
                                "DeepSpeed launcher never passes to the processes and retrofit does not run under "
                                "DeepSpeed: drop the config's dynamo_config (and --dynamo_backend)")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend not in ("", "no") and not compile_:
        raise RetrofitError(f"the accelerate config asks for torch.compile (dynamo_backend {backend}) but "
                            "train.compile is false: set train.compile: true or drop the config's dynamo_config")


def _parent_args() -> list[str] | None:
    """The command line of the process that started this one (Linux /proc; None elsewhere or when unreadable)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def _option(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def launcher_dynamo(args: list[str] | None = None) -> str | None:
    """The dynamo backend the `accelerate launch` that started this worker was given: its --dynamo_backend, else its
    config file's dynamo_config (--config_file, else accelerate's default file). None: not started by `accelerate
    launch` on this machine (its single-node DeepSpeed launch is the workers' parent), or nothing said."""
    args = _parent_args() if args is None else args
    if not args or not any(Path(a).name == "accelerate" or a.endswith("accelerate.commands.accelerate_cli")
                           for a in args[:3]) or "launch" not in args[:4]:
        return None
    given = _option(args, "--dynamo_backend", "--dynamo-backend")
    if given is not None:
        return given.lower()
    path = _option(args, "--config_file", "--config-file")
    if path is None:
        from accelerate.commands.config.config_args import default_config_file
        path = default_config_file
    try:
        import yaml
        with open(path, encoding="utf-8") as f:
            config = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):  # accelerate read it to start this process: rarely reached
        return None
    dynamo = config.get("dynamo_config") if isinstance(config, dict) else None
    backend = dynamo.get("dynamo_backend") if isinstance(dynamo, dict) else None
    return str(backend).lower() if backend is not None else None


# ---- what ran ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Engine:
    """What trained the run, as result.json's "engine" and log.jsonl's first line record it."""

    name: str                      # "single", "ddp", "fsdp2" (train.fsdp), "fsdp" (accelerate's), "deepspeed"
    world: int                     # processes
    backend: str | None            # the process group's (gloo, nccl); None for one process
    nodes: int = 1                 # machines (world / processes per machine)
    stage: int | None = None       # the ZeRO stage under DeepSpeed
    sequence_parallel: int = 1     # processes per row

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """`engine deepspeed ZeRO-3, 2 processes on 1 node (gloo)`: the run's first printed line."""
        stage = f" ZeRO-{self.stage}" if self.stage is not None else ""
        sp = f", sequence parallel {self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        where = f" ({self.backend})" if self.backend else ""
        return (f"engine {self.name}{stage}, {self.world} process(es) on {self.nodes} node(s){where}{sp}")


def what_ran(accelerator, train, stage: int | None = None) -> Engine:
    """The Engine of this run, from accelerate's state (never from what was asked)."""
    kind = accelerator.distributed_type.name
    world = accelerator.num_processes
    if kind == "DEEPSPEED":
        name = "deepspeed"
    elif kind == "FSDP":
        name = "fsdp"
    elif train.fsdp:
        name = "fsdp2"
    else:
        name = "ddp" if world > 1 else "single"
    dist = torch.distributed
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    return Engine(name, world, backend, nodes=max(1, world // max(1, local)), stage=stage,
                  sequence_parallel=train.sequence_parallel)


def check_ran(asked: Asked, engine: Engine) -> None:
    """Never a different engine silently: what was asked is what accelerate set up, or a one-line error."""
    want = {"deepspeed": "deepspeed", "fsdp": "fsdp"}.get(asked.engine)
    if want is not None and engine.name != want:
        raise RetrofitError(f"{asked.engine} was asked for but accelerate set up {engine.name}: launch with "
                            "accelerate launch --config_file (its config) or report this as a bug")
