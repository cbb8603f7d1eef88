"""The loop's periodic validation: each task's metrics on held-out batches at each evaluation length.

    metrics = validation_metrics(model, data, "lm", [64, 128], batches=2, batch_size=4, accelerator=acc)
    # {"eval/loss@64": 2.31, "eval/loss@128": 2.35}

Not `retrofit eval` (retrofit.evaluate: windows, intervals, reports); this runs inside training on the recipe's
data and feeds the log, the callbacks and result.json.
"""

from __future__ import annotations

import torch
from torch import nn

from ..logit_head import final_hidden, head_token_scores, next_tokens


@torch.no_grad()
def validation_metrics(model: nn.Module, data, task: str, lengths: list[int], batches: int, batch_size: int,
                       accelerator, chunk_tokens: int = 1024, progress: str | None = None) -> dict:
    """Validation metrics at each length: eval/loss@L (lm, passkey), eval/accuracy@L (passkey),
    eval/l1@L and eval/mse@L (counting). Each process takes every n-th row; sums are all-reduced. The head runs
    on chunk_tokens positions at a time (logit_head.head_token_scores), never on (b, T, V) logits.
    progress: a bar with this description, counting tokens (its rate and time left: the estimate)."""
    from tqdm.auto import tqdm
    rank, world = accelerator.process_index, accelerator.num_processes
    was_training = model.training
    model.eval()
    metrics = {}
    work = [(length, data.eval_batches(length, batches, batch_size)) for length in lengths]
    bar = tqdm(total=sum(int(b["input_ids"].numel()) for _, group in work for b in group), desc=progress,
               unit="tok", unit_scale=True, leave=False, dynamic_ncols=True, disable=progress is None)
    for length, group in work:
        sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, items, 2nd metric, examples
        for batch in group:
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
            bar.update(int(batch["input_ids"].numel()))
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
    bar.close()
    model.train(was_training)
    return metrics
