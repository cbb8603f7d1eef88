"""Setting up a run and ending it: the accelerator, the model (loaded or built, patched, calibrated, LoRA), the
optimizer; the processes' end. The per-step schedules (learning rate, length) are schedules.py.

Every function here is called by `retrofit.train.train` in this order, and each can be called on its
own (the experiment driver builds a base once and finetunes several arms from it):

    accelerator = make_accelerator(recipe.train, run_dir)
    model, tokenizer = load_base(recipe)                # retrofit.load: Hub | folder | .gguf | run | config
    report = apply_patch(model, recipe.patch)           # retrofit.load; None when patch.norm is null
    check_lengths(model, recipe)                        # GPT-2: 1024 learned positions unless nope
    model = wrap_task(model, recipe.data.task)          # counting -> CountingModel (backbone + head)
    calibrate_patch(model, data, recipe)
    model = apply_peft(model, recipe.train.peft)
    optimizer = make_optimizer(model, recipe.train)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs
from torch import nn

from ..attention_seam import BASE_OF
from ..calibration import calibrate
from ..errors import RetrofitError, check_token_ids
from ..load import CountingModel, language_model
from ..load.validate import quiet_peft
from ..norms import get_norm
from ..positions import position_limit
from ..recipe import PeftSection, Recipe, RecoverySection, TrainSection
from ..recovery import is_patch_parameter, scheduled_norms
from ..recovery.probe import schedule_costs
from ..recovery.schedule import endpoints
from . import engine, zero
from .runlog import JsonlTracker

# ---- processes -------------------------------------------------------------------------------------------------------

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


# ---- the model -------------------------------------------------------------------------------------------------------

def check_lengths(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before training, lengths the model cannot represent (learned absolute positions)."""
    lm = language_model(model)
    longest = max([recipe.data.seq_len, *recipe.loop_eval_lengths()])
    limit = position_limit(lm)
    if limit is not None and longest > limit:
        raise RetrofitError(f"length {longest} (data.seq_len / eval.lengths) exceeds {lm.config.model_type}'s {limit} "
                            "learned positions; set patch.nope: true (with a patch.norm) or use shorter lengths")
    if recipe.data.task == "counting" and lm.config.vocab_size < recipe.data.counting.alphabet:
        raise RetrofitError(f"the model's vocabulary ({lm.config.vocab_size}) is smaller than "
                            f"data.counting.alphabet ({recipe.data.counting.alphabet})")


# transformers' implementations whose mask function builds each packed row's block-causal mask from its position-id
# resets (transformers' create_causal_mask). flash-attention reads the resets only from one flattened row (its varlen
# path runs at batch size 1, transformers' _is_packed_sequence): rows of several documents would attend across them.
# retrofit's own implementations register their base's mask function (attention_seam.IMPLEMENTATIONS): they pack as
# their base does (BASE_OF).
PACKED_MASKS = ("sdpa", "eager", "flex_attention")


def check_packing(model: nn.Module, recipe: Recipe) -> None:
    """data.packing documents needs an implementation that confines attention to each document (PACKED_MASKS)."""
    implementation = language_model(model).config._attn_implementation
    if recipe.data.packing == "documents" and BASE_OF.get(implementation, implementation) not in PACKED_MASKS:
        raise RetrofitError(f"data.packing documents: attention implementation {implementation!r} would let a row's "
                            "documents attend to each other; load the model with sdpa or eager")


def check_vocabulary(model: nn.Module, tokenizer) -> None:
    """The tokenizer's ids fit the model's embedding (a mismatched model.tokenizer is an IndexError in step 1)."""
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        rows = language_model(model).get_input_embeddings().num_embeddings
        check_token_ids(max(tokenizer.get_vocab().values()), rows, "the tokenizer (model.tokenizer)", "the model")


def wrap_task(model: nn.Module, task: str, first_token: bool = False) -> nn.Module:
    """counting trains a regression head on the backbone (first_token: plus the L2 post's first-token table,
    data.counting.first_token); other tasks use the LM itself."""
    if task == "counting":
        if isinstance(model, CountingModel):
            has = model.first_token is not None
            if has != first_token:
                raise RetrofitError(f"the counting model passed in {'has' if has else 'has no'} first-token table but "
                                    f"data.counting.first_token is {first_token}; make them agree")
            return model
        return CountingModel(model, first_token=first_token)
    return language_model(model)


def calibrate_patch(model: nn.Module, data, recipe: Recipe) -> dict | None:
    """Calibrated per-head gains from the recipe's own data (see retrofit/calibration.py for why): AVNorm's
    (patch.calibrate_tokens), p-softmax's when patch.gain is set (recovery.calibrate_tokens)."""
    spec = recipe.patch.spec()
    if spec is None or not get_norm(spec.norm).calibrates(spec.norm_options):
        return None
    pretrained = recipe.model.source is not None
    tokens = recipe.patch.tokens_to_calibrate(pretrained=pretrained)
    if not get_norm(spec.norm).calibrated_by_default:  # asked for (psoftmax's gain): recovery.calibrate_tokens
        recovery = recipe.section("recovery")
        given = recovery.calibrate_tokens if recovery is not None else None
        tokens = given if given is not None else 8192 * pretrained
    if not tokens:
        return None
    batches = data.calibration(tokens, recipe.data.seq_len)
    return calibrate(language_model(model), batches)


def apply_peft(model: nn.Module, peft: PeftSection | None) -> nn.Module:
    """LoRA on the language model; the patch's `retrofit` children train too (modules_to_save)."""
    if peft is None:
        return model
    from peft import LoraConfig, get_peft_model  # imported here: PEFT costs ~1 s, and most runs train no LoRA

    lm = language_model(model)
    patched = any(n.endswith(".retrofit") and any(True for _ in m.parameters()) for n, m in lm.named_modules())
    config = LoraConfig(r=peft.r, lora_alpha=peft.alpha, lora_dropout=peft.dropout, task_type="CAUSAL_LM",
                        target_modules=peft.target_modules,
                        modules_to_save=["retrofit"] if peft.train_patch and patched else None)
    try:
        with quiet_peft():
            wrapped = get_peft_model(lm, config)
    except ValueError as err:  # no target module matched, unknown model type for default targets
        raise RetrofitError(f"train.peft: {str(err).splitlines()[0]}") from None
    if isinstance(model, CountingModel):
        model.lm = wrapped
        return model
    return wrapped


def enable_gradient_checkpointing(model: nn.Module) -> None:
    lm = language_model(model)
    kwargs = {"use_reentrant": False}  # the reentrant variant needs inputs that require grad (PEFT, frozen embeddings)
    enable = getattr(lm, "activation_checkpointing_enable", None)  # transformers >= 5.x name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    lm.config.use_cache = False


def activation_offload(enabled: bool, device):
    """The context the training forward runs in: torch.autograd.graph.save_on_cpu when train.activation_offload
    (every tensor saved for backward moves to CPU memory and comes back for its backward; pinned on CUDA), else
    nothing. On a CPU device it changes where nothing lives: the knob runs, memory and results are the same."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.device(device).type == "cuda")


def probe_schedule(model: nn.Module, data, recipe: Recipe, schedule):
    """shape=loss without costs: measure them on the first training block of the model as set up (before any
    checkpoint loads, so a resumed run measures the same model). Returns the schedule with its costs."""
    if schedule is None or schedule.shape != "loss" or schedule.costs is not None:
        return schedule
    length = recipe.data.seq_len
    ids = data.calibration(length, length)[0]["input_ids"][:1]  # (1, T): the first training block
    costs = schedule_costs(language_model(model), ids.to(next(model.parameters()).device), start=schedule.start,
                           end=schedule.end)
    return dataclasses.replace(schedule, costs=costs)


def check_recovery(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before training, a recovery section the patch or the task cannot serve (one-line errors)."""
    rec = recipe.section("recovery")
    if rec is None:
        return
    if recipe.patch.norm is None and (rec.distills() or rec.schedule or rec.patch_lr is not None or rec.freeze_base):
        raise RetrofitError("the recovery section needs a patch (patch.norm): a teacher, a schedule or a patch "
                            "learning rate on an unpatched model has nothing to act on")
    if rec.distills() and recipe.data.task != "lm":
        raise RetrofitError(f"recovery.kl_weight / match_steps distill next-token predictions; data.task is "
                            f"{recipe.data.task}: use the lm task or drop them")
    if rec.schedule is not None:
        need_steps = rec.schedule.steps
        if need_steps > recipe.train.steps:
            raise RetrofitError(f"recovery.schedule.steps ({need_steps}) exceeds train.steps ({recipe.train.steps}): "
                                "the run would end mid-schedule")
        norm = scheduled_norms(language_model(model))[0]  # a norm without a knob: one line naming those that have one
        endpoints(norm, rec.schedule.start, rec.schedule.end)  # an end its norm refuses (floor < 0): before training
        if rec.schedule.shape == "loss" and rec.schedule.costs is None and recipe.data.task != "lm":
            raise RetrofitError(f"recovery.schedule.shape loss without costs measures next-token losses, but "
                                f"data.task is {recipe.data.task}: give recovery.schedule.costs")
    if rec.match_steps >= recipe.train.steps:
        raise RetrofitError(f"recovery.match_steps ({rec.match_steps}) must be < train.steps ({recipe.train.steps})")


# ---- the optimizer and its schedule ---------------------------------------------------------------------------------

def param_groups(model: nn.Module, weight_decay: float, patch_group: bool = False) -> list[dict]:
    """Decay matrices only: never biases, norm weights, patch gains (all 1-D) or embedding tables.
    patch_group: the patch's own parameters (recovery.patch_lr) in a third group, "patch", without decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, patch, seen = [], [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if patch_group and is_patch_parameter(name):
            patch.append(p)
        else:
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return groups + ([{"params": patch, "weight_decay": 0.0, "name": "patch"}] if patch_group else [])


def freeze_base(model: nn.Module) -> None:
    """recovery.freeze_base: only the patch's own parameters train."""
    names = [n for n, p in model.named_parameters() if is_patch_parameter(n)]
    if not names:
        raise RetrofitError("recovery.freeze_base leaves nothing to train: the patch has no parameters "
                            "(avnorm, psoftmax with gain, softmax1 learnable and ssmax learned have some)")
    for name, p in model.named_parameters():
        p.requires_grad_(is_patch_parameter(name))


def make_optimizer(model: nn.Module, train: TrainSection, recovery: RecoverySection | None = None
                   ) -> torch.optim.Optimizer:
    patch_group = recovery is not None and recovery.patch_lr is not None
    groups = param_groups(model, train.weight_decay, patch_group)
    if not any(g["params"] for g in groups):
        raise RetrofitError("the model has no trainable parameter")
    if patch_group and not groups[-1]["params"]:
        raise RetrofitError("recovery.patch_lr is set but the patch has no trainable parameter; remove it")
    kwargs = dict(lr=train.lr, betas=tuple(train.betas), eps=train.adam_eps)
    try:  # the fused kernel: ~10x the default per-parameter loop on CPU, the fastest on CUDA too
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):  # a device or dtype it does not cover
        return torch.optim.AdamW(groups, **kwargs)


def describe(model: nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable"
