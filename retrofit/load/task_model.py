"""The task-model wrapper: a causal LM's backbone plus a counting head.

    model = CountingModel(lm)          # input_ids (B, T) -> predicted running counts (B, T)
    lm = language_model(model)         # the Hugging Face (or PEFT) causal LM inside any task model

A counting run (`retrofit train` with data.task counting) saves the head next to the model
(task.json + task_head.safetensors); `retrofit.load.load` rebuilds this wrapper from them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..families import family_of

HEAD_FILE, TASK_FILE = "task_head.safetensors", "task.json"


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
