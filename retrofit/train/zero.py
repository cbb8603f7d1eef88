"""DeepSpeed ZeRO through accelerate: the loop's DeepSpeed engine, on GPUs and on CPU processes.

    accelerate launch --config_file ds_zero3.yaml -m retrofit train RECIPE         # accelerate's DeepSpeed config
    torchrun --nproc_per_node 2 -m retrofit train RECIPE train.deepspeed=ds.json  # a DeepSpeed JSON config
    deepspeed --num_gpus 8 --module retrofit train RECIPE train.deepspeed=ds.json

    plugin = make_plugin(train.deepspeed, train, accumulation, data_parallel, cpu)  # checked as DeepSpeed reads it
                                                          # (ds_config.py); the recipe fills its "auto"s
    state = full_state_dict(model)                        # ZeRO-3: gathered one module at a time (main process)

On CPU processes DeepSpeed's CPU accelerator runs over gloo: accelerate gates DeepSpeed on `not cpu`, so the
accelerator is built with cpu=False and a gloo process group (build.make_accelerator). The recipe stays the source
of truth for the optimizer (retrofit's AdamW and learning-rate schedule), the micro batch (accelerate asks for it
when prepare() gets no dataloader, as the loop's prepare does), clipping and precision: a DeepSpeed config that sets
one of them differently is refused in one line, naming the key. Checkpoints are DeepSpeed's own (every process writes
its partition), read back through a loader that unpickles tensors and three DeepSpeed records only (weights_only).
"""

from __future__ import annotations

import contextlib
import copy
import os

from ..errors import RetrofitError
from . import ds_config

FOLDER = "deepspeed"     # a checkpoint's subfolder holding DeepSpeed's files
TAG = "state"            # DeepSpeed's checkpoint tag inside it


def make_plugin(path: str | None, train, accumulation: int, data_parallel: int, cpu: bool):
    """accelerate's DeepSpeedPlugin, its config checked by ds_config.check before accelerate reads it and again after
    (the recipe filling its "auto"s): from train.deepspeed (a JSON config file; zero.Init off, as retrofit patches the
    whole model first) or, with path None, from accelerate's own config (ACCELERATE_DEEPSPEED_* set by its launcher;
    its deepspeed_config_file, when it names one, is checked first the same way)."""
    from accelerate.utils import DeepSpeedPlugin
    if path is None:
        named = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if named != "none":
            ds_config.check(ds_config.read(named, "the accelerate config's deepspeed_config_file"), train,
                            accumulation, data_parallel, cpu)
        try:
            plugin = DeepSpeedPlugin()
        except (ValueError, TypeError, AttributeError, KeyError) as err:  # accelerate's own checks of its config
            raise RetrofitError(f"the accelerate config's DeepSpeed section: {str(err).splitlines()[0]}") from None
    else:
        config = ds_config.read(path, "train.deepspeed")
        ds_config.check(copy.deepcopy(config), train, accumulation, data_parallel, cpu)
        config.setdefault("zero_optimization", {"stage": 0})
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
    configure(plugin, train, accumulation, data_parallel, cpu)
    return plugin


def _get(config: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return None
        config = config[key]
    return config


def configure(plugin, train, accumulation: int, data_parallel: int, cpu: bool) -> int:
    """Fill `plugin`'s config from the recipe and refuse what the loop would not honor (ds_config.check: DeepSpeed's
    own parse of it); returns the ZeRO stage."""
    return ds_config.check(plugin.deepspeed_config, train, accumulation, data_parallel, cpu,
                           zero3_init=plugin.zero3_init_flag)


def check_deepspeed_recipe(recipe, stage: int | None) -> None:
    """Refuse, in one line, what the loop does not run under DeepSpeed (stage None: not DeepSpeed) yet."""
    if stage is None:
        return
    if recipe.section("recovery") is not None:
        raise RetrofitError("DeepSpeed with a recovery section is not built yet (its patch-only steps and schedules "
                            "act on gradients and weights DeepSpeed holds): drop one of them")
    if recipe.train.compile:
        raise RetrofitError("DeepSpeed with train.compile is not built yet: drop one of them")
    if recipe.train.sequence_parallel > 1 and recipe.train.init_len is not None:
        raise RetrofitError("DeepSpeed's sequence parallelism (ALST) takes a fixed micro batch of rows, which a staged "
                            "length (train.init_len) changes: drop train.init_len or train.sequence_parallel")
    peft = recipe.train.peft
    if stage == 3 and peft is not None and peft.save != "adapter":
        raise RetrofitError(f"ZeRO-3 with LoRA saves the adapter only (train.peft.save is {peft.save!r}): set "
                            "train.peft.save: adapter; the run then loads with retrofit.from_pretrained(run), which "
                            "can merge it")


@contextlib.contextmanager
def whole_model(accelerator):
    """The block builds the model whole, as one process would (the same initial weights, patched and calibrated).

    transformers builds a model already partitioned (deepspeed.zero.Init) whenever a ZeRO-3 config object is alive,
    and accelerate's plugin makes one whatever its zero3_init_flag says (accelerate 1.15, transformers 5.24: a
    2-process run started from other random weights than one process). DeepSpeed partitions the whole model
    when accelerate prepares it, so the config is hidden from transformers for the block and given back after."""
    if accelerator.distributed_type.name != "DEEPSPEED":
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        live = getattr(accelerator.state.deepspeed_plugin, "dschf", None)
        if live is not None:
            set_hf_deepspeed_config(live)


def parallelism_config(sequence_parallel: int, world: int):
    """accelerate's ParallelismConfig for train.sequence_parallel N under DeepSpeed (None for 1): its prepare() then
    registers DeepSpeed's ALST (UlyssesSPAttentionHF) around retrofit's adapter (alst.alst_attention) and hands
    ALST's groups to the engine. The world / N sequence groups are its data-parallel replicas (accelerate sizes
    DeepSpeed's train_batch_size from them)."""
    if sequence_parallel == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from .alst import reset_alst
    from .sequence_parallel import ALST_NAME
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    # accelerate accepts only the names of kernels it knows; the core ALST wraps is retrofit's adapter, which runs
    # the model's own implementation (sdpa, eager or a retrofit norm) on the rank's heads
    handler.sp_attn_implementation = ALST_NAME
    reset_alst()
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sequence_parallel, sp_handler=handler,
                             dp_replicate_size=world // sequence_parallel)


def stage_of(accelerator) -> int | None:
    """The ZeRO stage DeepSpeed runs (None: not DeepSpeed)."""
    if accelerator.distributed_type.name != "DEEPSPEED":
        return None
    return int(_get(accelerator.state.deepspeed_plugin.deepspeed_config, "zero_optimization.stage") or 0)


def is_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def partitioned(param) -> bool:
    """A ZeRO-3 parameter: its tensor is an empty placeholder outside a gather; this process holds `ds_tensor`."""
    return hasattr(param, "ds_tensor")


def local(param):
    """This process's values of a parameter: its ZeRO-3 partition, or the parameter itself."""
    return param.ds_tensor if partitioned(param) else param


# ---- the final model ---------------------------------------------------------------------------------------------

def full_state_dict(model) -> dict | None:
    """Every weight, unpartitioned, on the main process (None elsewhere): ZeRO-3 gathers one module at a time (a
    collective: every process calls it); ZeRO 0-2 keep whole weights in every process."""
    if model.zero_optimization_partition_weights():
        return model._zero3_consolidated_16bit_state_dict()  # what accelerate's get_state_dict calls, minus its flag
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


# ---- resumable checkpoints: DeepSpeed's files, read back without unpickling code ------------------------------------

def _allowed():
    """The non-tensor records DeepSpeed puts in its checkpoints (found by loading them with weights_only=True)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_checkpoint_engine():
    """DeepSpeed's checkpoint reader made torch.load(weights_only=True): tensors, containers and the records above;
    a pickled object of any other class is refused by torch rather than run."""
    import torch
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class WeightsOnly(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(_allowed()):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnly()


def check_files(folder) -> None:
    """Every DeepSpeed file of the checkpoint read as data before DeepSpeed reads any: a truncated or planted file is
    one line naming it, on every process alike (each reads them all, mmap: the structure, not the tensors' bytes),
    before load_checkpoint's collectives (there rank 0 raised torch's zip error and its peer lost the connection)."""
    import torch

    from .fsdp import not_data
    for path in sorted((folder / FOLDER / TAG).glob("*.pt")):
        try:
            with torch.serialization.safe_globals(_allowed()):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 -- whatever torch raises on it: not a file it can read as data
            raise not_data(path, err) from None


def save_state(folder, engine) -> None:
    """Every process writes its partition of the weights and optimizer state into folder/deepspeed (collective)."""
    engine.save_checkpoint(str(folder / FOLDER), tag=TAG, save_latest=False)


def load_state(folder, engine) -> None:
    """The inverse of save_state, in place, on the same number of processes (collective)."""
    if not (folder / FOLDER / TAG).is_dir():
        raise RetrofitError(f"{folder} holds no {FOLDER}/ state: it was not written under DeepSpeed; resume with "
                            "the launch and recipe it was trained with")
    check_files(folder)
    engine.checkpoint_engine = safe_checkpoint_engine()
    path, _ = engine.load_checkpoint(str(folder / FOLDER), tag=TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=False, load_module_strict=True)
    if path is None:
        raise RetrofitError(f"DeepSpeed could not read the checkpoint in {folder / FOLDER}; resume from another")

