"""The training loss of each task, summed (the loop divides by the global item count, known before any forward).

    lm, passkey   cross-entropy of token t+1 from position t (labels -100 are ignored)
    counting      L1 between the running count and a linear head on the residual stream before the final norm
                  (the head is retrofit.load.CountingModel)

The periodic validation metrics are validation.py; saving and loading a finished run is retrofit.load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..logit_head import final_hidden, head_loss_sum, model_inputs, next_tokens
from ..recovery import kl_and_ce_sum, match_sum


def items(batch: dict, task: str) -> int:
    """How many terms the loss averages over (known before any forward, so gradients can be exact means)."""
    if task == "counting":
        ids = batch["input_ids"]
        return ids.shape[0] * (ids.shape[1] - 1)
    return int((batch["labels"][:, 1:] != -100).sum())


def loss_sum(model: nn.Module, batch: dict, task: str, chunk_tokens: int = 1024) -> torch.Tensor:
    """Sum (not mean) of the per-item losses of `batch`; the caller divides by the global item count.
    lm/passkey: the body's final hidden states, then the head and cross-entropy on chunk_tokens positions at a time
    (logit_head.head_loss_sum: no (B, T, V) logits, forward or backward); chunk_tokens 0 = the model's own
    full-logits forward (more memory, no recomputation: the reference the chunked loss equals)."""
    if task == "counting":
        pred = model(batch["input_ids"])                      # (B, T)
        return (pred[:, 1:] - batch["counts"][:, 1:]).abs().sum()
    # a sequence-parallel shard (train/sequence_parallel.shard) brings labels shifted over the whole row
    labels = batch["shift_labels"] if "shift_labels" in batch else next_tokens(batch["labels"])  # (B, T)
    if not chunk_tokens:
        logits = model(**model_inputs(batch), use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return head_loss_sum(model, final_hidden(model, batch), labels, chunk_tokens=chunk_tokens)


def recovery_loss_sum(model: nn.Module, batch: dict, task: str, recovery, step: int,
                      chunk_tokens: int = 1024) -> torch.Tensor:
    """The recipe's recovery losses (retrofit.recovery.distill), summed like loss_sum: attention-output matching
    for the first recovery.match_steps updates, then lm_weight * CE + kl_weight * KL(teacher || student)."""
    if step < recovery.match_steps:
        return match_sum(model, batch)
    if not recovery.kl_weight:
        return recovery.lm_weight * loss_sum(model, batch, task, chunk_tokens)
    return kl_and_ce_sum(model, batch, lm_weight=recovery.lm_weight, kl_weight=recovery.kl_weight,
                         temperature=recovery.kl_temperature, chunk_tokens=recovery.chunk_tokens)
