"""The model a run trains, made from the loaded (and patched) one: the task's wrapper, the patch's calibrated gains,
LoRA, gradient checkpointing, activation offload, and the costs a loss-shaped recovery schedule needs.

    model = wrap_task(model, recipe.data.task)          # counting -> CountingModel (backbone + head)
    calibrate_patch(model, data, recipe)                # per-head gains from the recipe's own data
    model = apply_peft(model, recipe.train.peft)        # LoRA; the patch's children train too
    enable_gradient_checkpointing(model)
    schedule = probe_schedule(model, data, recipe, schedule)
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ..calibration import calibrate
from ..errors import RetrofitError
from ..load import CountingModel, language_model
from ..load.validate import quiet_peft
from ..norms import get_norm
from ..recipe import PeftSection, Recipe
from ..recovery.probe import schedule_costs


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
