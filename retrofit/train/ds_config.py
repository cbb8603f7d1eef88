"""A DeepSpeed config, read as DeepSpeed reads it, checked against the recipe before any process group exists.

    config = read(path, "train.deepspeed")               # a JSON object, or one line naming the file
    stage = check(config, train, accumulation, data_parallel, cpu)   # fills the recipe's "auto"s in place; refuses

Every launcher comes through `check` (zero.make_plugin): train.deepspeed under torchrun or `deepspeed`, and accelerate's
DeepSpeed config (its deepspeed_config_file first, then the config accelerate builds from it or from its own keys).
The config is parsed by DeepSpeed's own DeepSpeedConfig (its pydantic models: zero_optimization, bf16, fp16,
tensor_parallel, ...), so a value means here what it means to DeepSpeed: `"enabled": 1`, "true" and "yes" are on,
"auto" is the default. What DeepSpeed refuses is one line naming the key (its pydantic errors are several lines and
its other failures a TypeError); what DeepSpeed accepts but the recipe decides is refused when they differ. The table
of every key retrofit reads, honors, fills or refuses: docs/many-gpus.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging

from ..errors import RetrofitError, read_utf8

CONFIG_LIMIT = 1 << 20   # a DeepSpeed JSON config is small: refuse anything larger before reading it

# Sections DeepSpeed reads as objects (`Model(**section)`: anything else is a TypeError inside DeepSpeed)
OBJECTS = ("zero_optimization", "bf16", "bfloat16", "fp16", "tensor_parallel", "compile", "activation_checkpointing",
           "checkpoint", "data_types", "aio", "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor",
           "comet", "elasticity", "autotuning", "data_efficiency", "hybrid_engine", "pipeline", "torch_autocast",
           "timers", "nebula", "compression_training", "sparse_attention", "weight_quantization", "optimizer",
           "scheduler", "amp")
# DeepSpeed's pydantic model -> the section it reads (its errors name the model, not the key)
SECTION_OF = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
              "TPTrainingConfig": "tensor_parallel", "CompileConfig": "compile",
              "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
              "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
              "DeepSpeedCheckpointConfig": "checkpoint", "HybridEngineConfig": "hybrid_engine"}


def read(path: str, what: str) -> dict:
    """The JSON object in `path` (train.deepspeed, or accelerate's deepspeed_config_file)."""
    try:
        config = json.loads(read_utf8(path, what, most=CONFIG_LIMIT))
    except json.JSONDecodeError as err:
        raise RetrofitError(f"{what} {path} is not JSON ({err.msg}, line {err.lineno}); give a DeepSpeed config "
                            "file") from None
    if not isinstance(config, dict):
        raise RetrofitError(f"{what} {path} is not a DeepSpeed config object ({{\"zero_optimization\": "
                            "{\"stage\": 3}, ...})")
    return config


def _fill(config: dict, dotted: str, value, why: str) -> None:
    """Set `dotted` to the recipe's value where the config leaves it out or says "auto"; refuse a different one."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        config = config.setdefault(key, {})
    given = config.get(leaf, "auto")
    if given == "auto":
        config[leaf] = value
    elif given != value or isinstance(given, bool):
        raise RetrofitError(f"the DeepSpeed config's {dotted} is {given!r} but the recipe's {why} makes it {value!r}: "
                            f"set it to \"auto\" (or {value!r}) and let the recipe decide")


def _check_shapes(config: dict) -> None:
    for key in OBJECTS:
        if key in config and not isinstance(config[key], dict):
            example = '{"stage": 3}' if key == "zero_optimization" else '{"enabled": true, ...}'
            raise RetrofitError(f"the DeepSpeed config's {key} is {json.dumps(config[key])}, not an object as "
                                f"DeepSpeed reads it: write \"{key}\": {example}")


def _one_line(err: Exception, config: dict) -> str:
    """DeepSpeed's refusal in one line naming the key: its pydantic errors name the model and a path inside it."""
    errors = getattr(err, "errors", None)
    if callable(errors) and hasattr(err, "title"):
        first = errors()[0]
        section = SECTION_OF.get(err.title, err.title)
        if section == "bf16" and "bf16" not in config:
            section = "bfloat16"  # DeepSpeed's older name for the same section
        key = ".".join([section, *(str(part) for part in first["loc"])])
        return f"the DeepSpeed config's {key}: {first['msg']} (given {json.dumps(first.get('input'), default=str)})"
    return f"the DeepSpeed config: {(str(err).strip().splitlines() or [type(err).__name__])[0]}"


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeedConfig logs its world size and deprecations at INFO/WARNING on every process: this parse is a check."""
    log = logging.getLogger("DeepSpeed")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def parse(config: dict):
    """DeepSpeed's own DeepSpeedConfig of `config` (a copy: DeepSpeed reads the batch size against the world, which
    no process group gives yet, so the total batch is left to retrofit's own check); one line when DeepSpeed refuses."""
    from deepspeed.runtime.config import DeepSpeedConfig
    _check_shapes(config)
    given = copy.deepcopy(config)
    given.pop("train_batch_size", None)
    try:
        with _quiet_deepspeed():
            return DeepSpeedConfig(given)
    except Exception as err:  # noqa: BLE001 -- pydantic's ValidationError, DeepSpeed's asserts and ValueErrors
        raise RetrofitError(_one_line(err, config) + ": fix that key (DeepSpeed's config reference gives its "
                            "values)") from None


def check(config: dict, train, accumulation: int, data_parallel: int, cpu: bool, zero3_init: bool = False) -> int:
    """Fill `config` (in place) from the recipe, parse it as DeepSpeed does and refuse what the loop would not honor;
    returns the ZeRO stage."""
    if not isinstance(config.get("zero_optimization", {}), dict):
        raise RetrofitError("the DeepSpeed config's zero_optimization is not an object: write it as "
                            "{\"stage\": 3, ...}")
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise RetrofitError(f"the DeepSpeed config has a {section} section, but the recipe's train section sets "
                                f"the {section} (AdamW, warmup + cosine): remove it from the DeepSpeed config")
    if accumulation != 1:
        raise RetrofitError("with DeepSpeed set train.micro_batch_size = batch_size / processes (no accumulation)")
    _fill(config, "train_micro_batch_size_per_gpu", train.micro_batch_size, "train.micro_batch_size")
    _fill(config, "gradient_accumulation_steps", accumulation, "accumulation")
    _fill(config, "train_batch_size", train.micro_batch_size * accumulation * data_parallel, "train.batch_size")
    _fill(config, "gradient_clipping", float(train.grad_clip), "train.grad_clip")
    ds = parse(config)
    stage = int(ds.zero_optimization_stage)
    if stage == 3 and zero3_init:
        raise RetrofitError("zero3_init_flag (deepspeed.zero.Init) builds the model already partitioned, but retrofit "
                            "patches and calibrates the whole model first: set zero3_init_flag: false")
    for part in ("offload_optimizer", "offload_param"):
        offload = getattr(ds.zero_config, part)
        device = getattr(offload, "device", None) or "none"
        device = str(getattr(device, "value", device))  # DeepSpeed keeps the enum's value (a str)
        if cpu and device != "none":
            raise RetrofitError(f"zero_optimization.{part} to {device}: these processes already run on the CPU, "
                                "there is nothing to offload from; set its device to none")
    if ds.tensor_parallel_config.autotp_size > 1:
        raise RetrofitError("the DeepSpeed config asks for tensor parallelism (tensor_parallel.autotp_size "
                            f"{ds.tensor_parallel_config.autotp_size}), which retrofit's loop does not run: remove it")
    for half, enabled in (("fp16", ds.float16_config.enabled), ("bf16", ds.bfloat16_config.enabled)):
        if enabled and train.precision != half:  # DeepSpeed's reading: 1, "true", "yes" are on; "auto" is off
            raise RetrofitError(f"the DeepSpeed config enables {half} but train.precision is {train.precision}: make "
                                f"them agree (train.precision {half}, or \"enabled\": \"auto\")")
    return stage
