"""The per-step schedules of a run: each parameter group's learning rate and the staged sequence length."""

from __future__ import annotations

import dataclasses
import math

from ..recipe import Recipe, RecoverySection, TrainSection


def lr_at(step: int, train: TrainSection) -> float:
    """Learning rate of update `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    return train.lr * (train.min_lr_ratio
                       + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def group_lrs(step: int, train: TrainSection, recovery: RecoverySection | None = None) -> dict[str, float]:
    """Learning rate of each parameter group at update `step`: the patch group on its own peak and warmup."""
    lr = lr_at(step, train)
    rates = {"decay": lr, "no_decay": lr, "patch": lr}
    if recovery is not None and recovery.patch_lr is not None:
        warmup = train.warmup_steps if recovery.patch_warmup_steps is None else recovery.patch_warmup_steps
        rates["patch"] = lr_at(step, dataclasses.replace(train, lr=recovery.patch_lr, warmup_steps=warmup))
    return rates


def seq_len_at(step: int, recipe: Recipe) -> int:
    """Staged length (L2-softmax post): init_len doubling every double_every steps, up to data.seq_len."""
    train, seq_len = recipe.train, recipe.data.seq_len
    if train.init_len is None:
        return seq_len
    return min(seq_len, train.init_len * 2 ** (step // train.double_every))
