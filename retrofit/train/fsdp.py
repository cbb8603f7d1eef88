"""FSDP2 units for a patched (and maybe LoRA) model: `shard_model(model)` instead of hand-placed fully_shard.

    from retrofit.train.fsdp import shard_model
    shard_model(model)             # under torchrun / accelerate, after retrofit.patch (and get_peft_model)

FSDP2 (`torch.distributed.fsdp.fully_shard`) flattens each unit's parameters into one buffer and refuses a
unit whose parameters have more than one dtype ("FSDP expects uniform original parameter dtype"): exactly
what LoRA makes of a bf16 model (PEFT upcasts its adapter weights to fp32) and what a patch child kept in
fp32 next to bf16 weights would be. So the units are, in order:
  1. every maximal subtree (that has a forward) whose parameters all share one dtype other than the model's
     main one (LoRA's lora_A/lora_B linears, a patch's `retrofit` child or its modules_to_save copy);
  2. every transformer block (the model's `_no_split_modules` classes);
  3. the root, holding what is left (embeddings, final norm, head).
FSDP2 also refuses 0-d parameters: every retrofit norm keeps its per-head parameters 1-D for that reason.
"""

from __future__ import annotations

import os
from collections import Counter

from torch import nn

from ..errors import RetrofitError


def _main_dtype(model: nn.Module):
    counts = Counter()
    for p in model.parameters():
        counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0]


def _block_classes(model: nn.Module) -> set[str]:
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def shard_model(model: nn.Module, *, fully_shard=None, **kwargs) -> list[str]:
    """Apply FSDP2 to `model` in uniform-dtype units (see the module docstring); returns the units' names.

    kwargs go to every fully_shard call (mesh, reshard_after_forward, mp_policy, ...)."""
    if fully_shard is None:
        from torch.distributed.fsdp import fully_shard
    zero_d = [n for n, p in model.named_parameters() if p.dim() == 0]
    if zero_d:
        raise RetrofitError(f"FSDP2 cannot shard 0-d parameters ({zero_d[0]}, ...): make them 1-D")
    main, units = _main_dtype(model), []

    def free(name, module):
        """The parameters of `module` no unit holds yet (by name: sharding replaces the Parameter objects)."""
        full = [(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters()]
        return [p for n, p in full if not any(n.startswith(u + ".") for u in units)]

    for name, module in model.named_modules():  # pre-order: the first uniform subtree met is the maximal one
        params = free(name, module)
        runs = type(module).forward is not nn.Module.forward  # containers (ModuleDict) cannot be units
        if runs and params and len(params) == len(list(module.parameters())) and module is not model and \
                {p.dtype for p in params} == {params[0].dtype} and params[0].dtype != main:
            fully_shard(module, **kwargs)
            units.append(name)
    blocks = _block_classes(model)
    for name, module in model.named_modules():
        left = {p.dtype for p in free(name, module)}
        if type(module).__name__ in blocks and left:
            if len(left) > 1:
                raise RetrofitError(f"{name} mixes parameter dtypes {sorted(map(str, left))} that no unit separates; "
                                    "cast the model to one dtype before sharding")
            fully_shard(module, **kwargs)
            units.append(name)
    fully_shard(model, **kwargs)
    return units + ["<root>"]


# ---- train.fsdp: the loop's FSDP2 path (CPU processes included; accelerate's FSDP plugin needs CUDA) -----------------

def check_fsdp_recipe(recipe, distributed_type: str) -> None:
    """Refuse, in one line, what train.fsdp does not run yet."""
    if not recipe.train.fsdp:
        return
    if distributed_type in ("FSDP", "DEEPSPEED"):
        raise RetrofitError(f"train.fsdp shards the model itself; accelerate already runs {distributed_type}: "
                            "set train.fsdp false or launch without accelerate's FSDP / DeepSpeed config")
    if distributed_type == "NO" and "RANK" not in os.environ:  # torch's own words: "environment variable RANK expected"
        raise RetrofitError("train.fsdp shards the model over several processes and needs a launcher: "
                            "torchrun --nproc_per_node N -m retrofit train RECIPE (or accelerate launch "
                            "--multi_gpu --num_processes N -m retrofit train RECIPE), or set train.fsdp false")
    if recipe.train.peft is not None and recipe.train.peft.save != "adapter":
        raise RetrofitError(f"train.fsdp with LoRA saves the adapter only (train.peft.save is "
                            f"{recipe.train.peft.save!r}): set train.peft.save: adapter; the run then loads with "
                            "retrofit.from_pretrained(run), which can merge it")
    if recipe.section("recovery") is not None:
        raise RetrofitError("train.fsdp with a recovery section is not built yet: drop one of them")
    if recipe.train.compile:
        raise RetrofitError("train.fsdp with train.compile is not built yet: drop one of them")


def prepare(model: nn.Module, make_optimizer, accelerator):
    """FSDP2 over every process (one mesh: each process holds 1/world of every unit, as ZeRO-3 / DeepSpeed ALST do
    under sequence parallelism), then the optimizer on the sharded parameters, prepared by accelerate alone.

    Gradients are reduce-scattered as a mean over all processes, like DDP's: the loop's loss scale (processes /
    global items) makes that mean the gradient of the global batch's mean loss, sequence groups included (each
    process's loss covers its own tokens, so the sum over every process is the whole batch)."""
    shard_model(model)
    return model, accelerator.prepare(make_optimizer(model))


def local(t):
    """A DTensor's local shard (or `t`): what a per-process check (finite weights) looks at."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t):
    """A DTensor's full value on every process (or `t`): the gradient norm clip_grad_norm_ returns under FSDP2."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_dict(model: nn.Module) -> dict:
    """Every unsharded tensor on the CPU of every process (a collective: all call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---- resumable checkpoints: each process writes its own shards (torch.distributed.checkpoint) -----------------------

SHARDS = "fsdp"  # the checkpoint's subfolder: one .distcp file per process, .metadata from the main one


def _options():
    """Frozen parameters are left out (a LoRA run's base: rebuilt from the same recipe, it never changes); the
    load is exact all the same, as dcp.load refuses a key the checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def _states(model: nn.Module, optimizer) -> dict:
    """The model's trained and optimizer's sharded state dicts (DTensors: each process holds its own shards). A
    fresh optimizer gets its state created first (a step at learning rate 0), so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model, options=_options()),
            "optim": get_optimizer_state_dict(model, _torch_optimizer(optimizer), options=_options())}


def save_shards(folder, model: nn.Module, optimizer) -> None:
    """Every process writes its shards of the model and optimizer into folder/fsdp (a collective: all call it)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(_states(model, optimizer), checkpoint_id=str(folder / SHARDS))


def load_shards(folder, model: nn.Module, optimizer) -> None:
    """The inverse of save_shards, in place, on the same number of processes (a collective). Read as data only
    (shard_reader): a planted pickle in the folder is refused, never run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    if not (folder / SHARDS).is_dir():
        raise RetrofitError(f"{folder} holds no {SHARDS}/ shards: it was not written under train.fsdp; resume "
                            "with the recipe it was trained with")
    states = _states(model, optimizer)
    reader, planner = shard_reader(folder / SHARDS)
    try:  # first on its own: dcp.load logs a traceback for a .metadata it cannot read, then for each fallback
        reader.read_metadata()
    except Exception as err:  # noqa: BLE001 -- the allow-list's refusal, a truncated or missing file
        raise not_data(folder / SHARDS / ".metadata", err) from None
    try:
        dcp.load(states, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 -- dcp gathers each process's error into one
        raise not_data(folder / SHARDS, err) from None
    set_model_state_dict(model, states["model"], options=_options())
    set_optimizer_state_dict(model, _torch_optimizer(optimizer), states["optim"], options=_options())


def not_data(path, err: BaseException) -> RetrofitError:
    """The one-line refusal of resume state that cannot be read as data (a planted pickle, a damaged file)."""
    return RetrofitError(f"{path} is not data retrofit can read as training state ({failure_reason(err)}); it was not "
                         "written by retrofit: restore the run folder, or start the run again in another output.dir")


def failure_reason(err: BaseException) -> str:
    """Why a file could not be read as data, in a few words on one line: the first process's own error out of dcp's
    CheckpointException (a traceback per process), the allow-list's words out of torch's weights-only message."""
    failures = getattr(err, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    text = " ".join(str(err).split()) or type(err).__name__
    for start, end in (("WeightsUnpickler error: ", ". "), ("metadata read failed: ", ";")):
        if start in text:
            text = text.split(start, 1)[1].split(end, 1)[0]
    return text[:160] + ("..." if len(text) > 160 else "")


# torch.distributed.checkpoint reads .metadata with pickle.load and each non-tensor value (AdamW's lr, betas) with
# torch.load(weights_only=False): code planted in either runs. What retrofit lets them hold: the classes of the
# metadata torch writes (checked on torch 2.13) and, for values, what torch's weights-only unpickler takes.
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization",
                                                                                     "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


def shard_reader(path):
    """(storage reader, load planner) for dcp.load that read `path` as data only: .metadata through an allow-list
    unpickler (METADATA_GLOBALS and torch's dtypes), every non-tensor value through torch.load(weights_only=True);
    tensors are torch's own weights-only loads already."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                         torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f".metadata names {module}.{name}, which is not checkpoint metadata")

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:  # as torch's
                metadata = MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not checkpoint metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)  # numbers, strings, tuples, lists: never an object's code
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return DataOnlyReader(path), DataOnlyPlanner()
