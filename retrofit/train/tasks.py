"""What each task computes while training: its loss, and the periodic validation metrics.

    lm, passkey   cross-entropy of token t+1 from position t (labels -100 are ignored)
    counting      L1 between the running count and a linear head on the residual stream before the final norm
                  (the head is retrofit.load.CountingModel)

Saving and loading a finished run is retrofit.load (save_model, load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..logit_head import final_hidden, head_loss_sum, head_token_scores, model_inputs, next_tokens
from ..recovery import kl_and_ce_sum, match_sum

# ---- losses and evaluation -------------------------------------------------------------------------------------------

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


@torch.no_grad()
def evaluate(model: nn.Module, data, task: str, lengths: list[int], batches: int, batch_size: int,
             accelerator, chunk_tokens: int = 1024) -> dict:
    """Validation metrics at each length: eval/loss@L (lm, passkey), eval/accuracy@L (passkey),
    eval/l1@L and eval/mse@L (counting). Each process takes every n-th row; sums are all-reduced. The head runs
    on chunk_tokens positions at a time (logit_head.head_token_scores), never on (b, T, V) logits."""
    rank, world = accelerator.process_index, accelerator.num_processes
    was_training = model.training
    model.eval()
    metrics = {}
    for length in lengths:
        sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, items, 2nd metric, examples
        for batch in data.eval_batches(length, batches, batch_size):
            part = {k: v[rank::world] for k, v in batch.items() if torch.is_tensor(v)}
            weight = 1.0
            if len(part["input_ids"]) == 0:  # fewer rows than processes: run a row anyway (FSDP needs every rank)
                part, weight = {k: v[:1] for k, v in batch.items() if torch.is_tensor(v)}, 0.0
            part = {k: v.to(accelerator.device) for k, v in part.items()}
            if task == "counting":
                err = model(part["input_ids"])[:, 1:] - part["counts"][:, 1:]  # (b, T-1)
                values = [err.abs().sum(), err.numel(), err.pow(2).sum(), len(err)]
            else:
                labels = next_tokens(part["labels"])  # (b, T)
                losses, hit = head_token_scores(model, final_hidden(model, part), labels, chunk_tokens or 1024)
                mask = labels != -100
                correct = (hit | ~mask).all(1).sum()  # every answer token right
                values = [losses.sum(), mask.sum(), correct, len(labels)]
            sums += weight * torch.tensor([float(v) for v in values], dtype=torch.float64, device=sums.device)
        sums = accelerator.reduce(sums, "sum")
        if sums[1] == 0:
            continue
        if task == "counting":
            metrics[f"eval/l1@{length}"] = float(sums[0] / sums[1])
            metrics[f"eval/mse@{length}"] = float(sums[2] / sums[1])
        else:
            metrics[f"eval/loss@{length}"] = float(sums[0] / sums[1])
            if task == "passkey":
                metrics[f"eval/accuracy@{length}"] = float(sums[2] / sums[3])
    model.train(was_training)
    return metrics
