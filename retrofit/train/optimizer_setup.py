"""What trains and how: the optimizer's parameter groups (decay on matrices only; the patch's own group for
recovery.patch_lr), recovery.freeze_base, the fused AdamW, and the one-line count of what trains.

    freeze_base(model)                                   # recovery.freeze_base: only the patch trains
    optimizer = make_optimizer(model, recipe.train, recipe.section("recovery"))
    describe(model)                                      # "124.44M parameters, 0.01M trainable"
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RetrofitError
from ..recipe import RecoverySection, TrainSection
from ..recovery import is_patch_parameter


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
