"""The task-model wrapper: a causal LM's backbone plus a counting head.

    model = CountingModel(lm)          # input_ids (B, T) -> predicted running counts (B, T)
    model = CountingModel(lm, first_token=True)   # + a learned 2-row table: first token / any other (the L2 post)
    lm = language_model(model)         # the Hugging Face (or PEFT) causal LM inside any task model

A counting run (`retrofit train` with data.task counting) saves the head next to the model
(task.json + task_head.safetensors); `retrofit.load.load` rebuilds this wrapper from them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RetrofitError
from ..families import family_of

HEAD_FILE, TASK_FILE = "task_head.safetensors", "task.json"


class CountingModel(nn.Module):
    """A causal LM's backbone plus a regression head: input_ids (B, T) -> predicted counts (B, T), fp32.

    The head reads the residual stream *before* the backbone's final norm: the count grows with the
    length, and after an RMS/LayerNorm the hidden state has a fixed magnitude, so a linear readout of
    it is bounded by |w|*sqrt(d) and could never follow a count beyond the trained range, whatever the
    attention does. The LM head and that final norm are not used; they are frozen (the head unless
    tied to the embeddings) so that DDP sees no parameter without a gradient.

    `first_token=True` adds a learned 2-row table to the token embeddings, row 0 at the first token and row 1 at
    every other: the L2-softmax post's only position signal (its train.py: `pos(arange(T) > 0)`). With the
    backbone's own positions removed (patch.nope) the model can tell the first token from the rest and nothing
    else."""

    def __init__(self, lm: nn.Module, head: nn.Linear | None = None, first_token: bool = False):
        super().__init__()
        self.lm = lm
        ref = next(lm.parameters())
        self.head = head or nn.Linear(lm.config.hidden_size, 1).to(device=ref.device, dtype=ref.dtype)
        self.first_token = None
        if first_token:  # initialized as the embeddings are (config.initializer_range), from the seeded global RNG
            self.first_token = nn.Embedding(2, lm.config.hidden_size).to(device=ref.device, dtype=ref.dtype)
            nn.init.normal_(self.first_token.weight, std=getattr(lm.config, "initializer_range", 0.02))
        out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            out.requires_grad_(False)
        norm = final_norm(lm.get_base_model() if hasattr(lm, "get_base_model") else lm)
        if norm is not None:  # read past (see above): no gradient reaches it
            norm.requires_grad_(False)

    def task_state(self, gathered: dict | None = None) -> dict:
        """What the run folder saves beside the model (task_head.safetensors): the head, and the first-token table.
        gathered: the whole model's state dict as a sharded run gathers it (FSDP2, ZeRO-3), read instead of the
        modules, whose own tensors hold this process's shard only."""
        if gathered is not None:
            state = {k.removeprefix("head."): v for k, v in gathered.items() if k.startswith(("head.", "first_token."))}
        else:
            state = {k: v for k, v in self.head.state_dict().items()}
            if self.first_token is not None:
                state |= {f"first_token.{k}": v for k, v in self.first_token.state_dict().items()}
        return {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def load_task_state(self, state: dict) -> None:
        """The inverse of task_state (the keys must match: a missing or extra table is an error)."""
        table = {k.removeprefix("first_token."): v for k, v in state.items() if k.startswith("first_token.")}
        self.head.load_state_dict({k: v for k, v in state.items() if not k.startswith("first_token.")})
        if self.first_token is not None or table:
            if self.first_token is None:
                raise RetrofitError("the saved counting head has a first-token table but task.json does not say "
                                    "first_token: true; the run folder is inconsistent, retrain or fix task.json")
            self.first_token.load_state_dict(table)

    @property
    def config(self):
        return language_model(self).config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        core = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm  # through PEFT
        captured = {}
        norm = final_norm(core)
        hook = norm.register_forward_pre_hook(lambda m, args: captured.update(h=args[0])) if norm is not None else None
        inputs = {"input_ids": input_ids}
        if self.first_token is not None:  # (B, T, C) token embeddings + row 0 at position 0, row 1 after it
            flag = (torch.arange(input_ids.shape[1], device=input_ids.device) > 0).long()  # (T,)
            inputs = {"inputs_embeds": core.get_input_embeddings()(input_ids) + self.first_token(flag)}
        try:
            out = core.base_model(**inputs, attention_mask=attention_mask, use_cache=False)
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
