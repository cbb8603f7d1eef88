"""What each task computes, how a trained run is saved, and how it comes back.

    lm, passkey   cross-entropy of token t+1 from position t (labels -100 are ignored)
    counting      L1 between the running count and a linear head on the residual stream before the final norm

    model = load_run("runs/counting")            # CountingModel: model(input_ids) -> counts (B, T)
    model = load_run("runs/gpt2-avnorm")         # the patched LM (same as retrofit.from_pretrained)

A run folder holds the model as `save_pretrained` writes it (safetensors; the patch in config.json),
the tokenizer if any, and for counting `task.json` + `task_head.safetensors`. A LoRA run holds the
merged model there and/or the adapter in `adapter/`, rebuilt on its base from `recipe.yaml`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RetrofitError

HEAD_FILE, TASK_FILE, ADAPTER_DIR = "task_head.safetensors", "task.json", "adapter"


class CountingModel(nn.Module):
    """A causal LM's backbone plus a regression head: input_ids (B, T) -> predicted counts (B, T), fp32.

    The head reads the residual stream *before* the backbone's final norm: the count grows with the
    length, and after an RMS/LayerNorm the hidden state has a fixed magnitude, so a linear readout of
    it is bounded by |w|*sqrt(d) and could never follow a count beyond the trained range, whatever the
    attention does. The LM head and that final norm are not used; they are frozen (the head unless
    tied to the embeddings) so that DDP sees no parameter without a gradient."""

    def __init__(self, lm: nn.Module, head: nn.Linear | None = None):
        super().__init__()
        self.lm = lm
        ref = next(lm.parameters())
        self.head = head or nn.Linear(lm.config.hidden_size, 1).to(device=ref.device, dtype=ref.dtype)
        out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            out.requires_grad_(False)
        norm = final_norm(lm.get_base_model() if hasattr(lm, "get_base_model") else lm)
        if norm is not None:  # read past (see above): no gradient reaches it
            norm.requires_grad_(False)

    @property
    def config(self):
        return language_model(self).config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        core = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm  # through PEFT
        captured = {}
        norm = final_norm(core)
        hook = norm.register_forward_pre_hook(lambda m, args: captured.update(h=args[0])) if norm is not None else None
        try:
            out = core.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        hidden = captured.get("h", out.last_hidden_state)  # (B, T, C)
        return self.head(hidden).squeeze(-1).float()  # (B, T)


def final_norm(lm: nn.Module) -> nn.Module | None:
    """The norm before the LM head, from the family table (None for families not in it)."""
    from ..families import family_of
    family = family_of(lm.config)
    if family is None:
        return None
    try:
        return lm.get_submodule(family.final_norm)
    except AttributeError:
        return None


def language_model(model: nn.Module) -> nn.Module:
    """The Hugging Face (or PEFT) causal LM inside `model`."""
    return model.lm if isinstance(model, CountingModel) else model


# ---- losses and evaluation -------------------------------------------------------------------------------------------

def items(batch: dict, task: str) -> int:
    """How many terms the loss averages over (known before any forward, so gradients can be exact means)."""
    if task == "counting":
        ids = batch["input_ids"]
        return ids.shape[0] * (ids.shape[1] - 1)
    return int((batch["labels"][:, 1:] != -100).sum())


def loss_sum(model: nn.Module, batch: dict, task: str) -> torch.Tensor:
    """Sum (not mean) of the per-item losses of `batch`; the caller divides by the global item count."""
    if task == "counting":
        pred = model(batch["input_ids"])                      # (B, T)
        return (pred[:, 1:] - batch["counts"][:, 1:]).abs().sum()
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), next_tokens(batch["labels"]).flatten(), ignore_index=-100,
                           reduction="sum")


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """labels shifted left with -100 at the end: position t is scored on token t+1. Shifting the labels
    instead of the logits avoids copying the (B, T, vocab) logits."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


@torch.no_grad()
def evaluate(model: nn.Module, data, task: str, lengths: list[int], batches: int, batch_size: int,
             accelerator) -> dict:
    """Validation metrics at each length: eval/loss@L (lm, passkey), eval/accuracy@L (passkey),
    eval/l1@L and eval/mse@L (counting). Each process takes every n-th row; sums are all-reduced."""
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
                logits = model(input_ids=part["input_ids"], use_cache=False).logits  # (b, T, V)
                labels = next_tokens(part["labels"])
                mask = labels != -100
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                       reduction="sum")
                correct = ((logits.argmax(-1) == labels) | ~mask).all(1).sum()  # every answer token right
                values = [loss, mask.sum(), correct, len(labels)]
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


# ---- saving and loading a finished run -------------------------------------------------------------------------------

def save_model(model: nn.Module, run_dir, *, tokenizer=None, peft_save: str | None = None, state_dict=None) -> nn.Module:
    """Write the final model into run_dir; returns the model as saved (a LoRA model comes back merged
    when the merged form was written). Call on the main process with the unwrapped model."""
    from safetensors.torch import save_file
    run_dir = Path(run_dir)
    lm = language_model(model)
    if peft_save is not None:
        if peft_save in ("adapter", "both"):
            lm.save_pretrained(run_dir / ADAPTER_DIR)
        if peft_save in ("merged", "both"):
            lm = lm.merge_and_unload()
            lm.save_pretrained(run_dir)
            if isinstance(model, CountingModel):
                model.lm = lm
    else:
        if state_dict is not None and isinstance(model, CountingModel):
            state_dict = {k[3:]: v for k, v in state_dict.items() if k.startswith("lm.")}
        lm.save_pretrained(run_dir, state_dict=state_dict)
    if isinstance(model, CountingModel):
        head = {k: v.detach().contiguous().cpu() for k, v in model.head.state_dict().items()}
        save_file(head, str(run_dir / HEAD_FILE))
        (run_dir / TASK_FILE).write_text(json.dumps({"task": "counting", "head": "linear",
                                                     "hidden_size": model.head.in_features}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(run_dir)
    return model if isinstance(model, CountingModel) else lm


def load_run(source, *, adapter: bool = False, dtype=None, attn_implementation: str = "sdpa", revision=None):
    """A finished run folder (or any model source: Hub id, folder, .gguf) as a model ready to evaluate or
    finetune: the (patched) LM, or a CountingModel when the run trained a counting head. `adapter=True`
    rebuilds a LoRA run from its base (recipe.yaml) and `adapter/`, even when a merged model is there too."""
    from ..models import load_model
    run = Path(str(source)).expanduser()
    has_model = (run / "config.json").is_file()
    if adapter or (run.is_dir() and not has_model and (run / ADAPTER_DIR).is_dir()):
        lm = _load_adapter_run(run)
    else:
        lm = load_model(str(source), dtype=dtype, attn_implementation=attn_implementation, revision=revision)
    if not (run / TASK_FILE).is_file():
        return lm.eval()
    task = json.loads((run / TASK_FILE).read_text())
    if task.get("task") != "counting":
        raise RetrofitError(f"{run / TASK_FILE} names an unknown task {task.get('task')!r}")
    from safetensors.torch import load_file
    model = CountingModel(lm)
    model.head.load_state_dict(load_file(str(run / HEAD_FILE)))
    return model.eval()


def _load_adapter_run(run: Path) -> nn.Module:
    from peft import PeftModel

    from ..recipe import load_recipe
    from .build import apply_patch, load_base
    if not (run / ADAPTER_DIR).is_dir() or not (run / "recipe.yaml").is_file():
        raise RetrofitError(f"{run} has no adapter/ and recipe.yaml to rebuild a LoRA run from")
    summary = json.loads((run / "result.json").read_text()) if (run / "result.json").is_file() else {}
    if summary.get("model_from_recipe") is False:
        raise RetrofitError(f"{run}'s base model was passed in code, not built from its recipe, so its adapter "
                            "cannot be rebuilt; load the merged model (train.peft.save: merged or both)")
    recipe = load_recipe(run / "recipe.yaml")
    base, _ = load_base(recipe)
    apply_patch(base, recipe.patch)  # the calibrated / trained patch parameters come back from the adapter
    return PeftModel.from_pretrained(language_model(base), str(run / ADAPTER_DIR))
