"""One optimizer update: `train_step(run, step)`.

The step's global batch is built identically on every process; this process trains its slice of it in
`micro_batch_size` pieces (no gradient sync until the last) and divides every loss sum by the global item count,
so the gradient is the exact mean over the global batch for any number of processes or accumulation steps. With
train.sequence_parallel N, groups of N processes share each row (sequence_parallel.py: each scores its T/N
tokens; attention sees the whole row), and the groups split the batch.
"""

from __future__ import annotations

import contextlib

import torch

from ..recovery import apply_schedule
from . import fsdp, model_setup, schedules
from .losses import items, loss_sum, recovery_loss_sum
from .sequence_parallel import shard, sharded
from .state import Run, StepStats


def train_step(run: Run, step: int) -> StepStats:
    """Update `step` (0-based) on the step's global batch (see the module docstring); the log window and the
    divergence flag take its loss and gradient norm."""
    recipe = run.recipe
    length = schedules.seq_len_at(step, recipe)
    rows = recipe.train.batch_size * recipe.data.seq_len // length  # global rows at this length
    batch = run.data.batch(step, rows, length)                         # the global batch, identical on every process
    n_items = items(batch, recipe.data.task)
    rates = schedules.group_lrs(step, recipe.train, run.recovery)
    for group in run.optimizer.param_groups:
        group["lr"] = rates[group.get("name", "decay")]
    for part, last in _micro_batches(run, batch, rows):
        run.window.loss += _backward(run, part, step, n_items, last)
    grad_norm = _update(run, step)
    run.window.items, run.window.tokens = run.window.items + n_items, run.window.tokens + rows * length
    finite = torch.isfinite(run.window.loss)  # losses are >= 0: once not finite, the window sum stays so
    if torch.is_tensor(grad_norm):
        finite = finite & torch.isfinite(grad_norm)
    run.divergence.note(step + 1, finite)
    return StepStats(length, rates["decay"], grad_norm)


def _micro_batches(run: Run, batch: dict, rows: int):
    """(micro-batch on this process's device, whether it is the step's last) for this process's rows of the
    global batch; under sequence parallelism only this rank's tokens of each row."""
    split = run.split
    per_process = rows // split.world
    per_micro = per_process // split.accum
    for i in range(split.accum):
        lo = split.rank * per_process + i * per_micro
        part = {k: v[lo: lo + per_micro].to(run.acc.device) for k, v in batch.items() if torch.is_tensor(v)}
        yield (shard(part, split.layout) if split.layout else part), i == split.accum - 1


def _backward(run: Run, part: dict, step: int, n_items: int, last: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch (gradients synced across processes on the last only); returns its
    loss sum, detached, in float64."""
    acc, model, t = run.acc, run.model, run.recipe.train
    sync = contextlib.nullcontext() if last else acc.no_sync(model)
    with sync, sharded(model, run.split.layout), model_setup.activation_offload(t.activation_offload, acc.device):
        loss = _loss_sum(run, part, step)
        acc.backward(loss * (acc.num_processes / n_items))  # DDP averages over processes: world/n is the global mean
    return loss.detach().double()


def _loss_sum(run: Run, part: dict, step: int) -> torch.Tensor:
    rec, task, chunk_tokens = run.recovery, run.recipe.data.task, run.recipe.train.loss_chunk_tokens
    if rec is not None and (rec.lm_weight != 1.0 or rec.distills()):  # retrofit.recovery's losses
        return recovery_loss_sum(run.model, part, task, rec, step, chunk_tokens)
    return loss_sum(run.model, part, task, chunk_tokens)  # the task's own


def _update(run: Run, step: int) -> torch.Tensor | None:
    """Clip, step, zero the gradients, then set the schedule's knob for the next update (evaluation and
    checkpoints see it too). Returns the gradient norm (None without clipping)."""
    t, rec = run.recipe.train, run.recovery
    if rec is not None and step < rec.match_steps:  # stage one of recovery: only the patch's parameters train
        for p in run.base:
            p.grad = None  # fused AdamW skips a parameter without a gradient: no update, no moment change
    grad_norm = run.acc.clip_grad_norm_(run.trainable, t.grad_clip) if t.grad_clip > 0 else None
    grad_norm = fsdp.whole(grad_norm)  # train.fsdp: a DTensor
    if grad_norm is not None and not torch.is_tensor(grad_norm):  # DeepSpeed: the norm its step clipped, a float
        grad_norm = torch.tensor(float(grad_norm), dtype=torch.float64)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.schedule is not None:
        apply_schedule(run.model, run.schedule, step + 1)
    return grad_norm
