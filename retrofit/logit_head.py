"""The logit head and the loss, once: final hidden states -> float32 logits as the model's own forward makes them,
run a chunk of positions at a time. Training (train/losses.py), the loop's validation, `retrofit eval`
(evaluate/scoring.py) and distillation (recovery/distill.py) all score with it.

    hidden = final_hidden(model, batch)                        # (B, T, d): the body, through the model's forward
    loss = head_loss_sum(model, hidden, next_tokens(labels))   # CE (+ KL) summed; no (B, T, V) logits, fwd or bwd
    losses, correct = head_token_scores(model, hidden, labels)  # evaluation: per-position loss and argmax hit
    for part in chunk_slices(B, T, chunk_tokens):              # positions part of (B, T): about chunk_tokens each
        logits = head_logits(model, hidden[:, part])           # (B, c, d) -> (B, c, V): the only vocab-sized tensor

The final norm is the body's (the final hidden states callers pass are after it); the head is the output
projection then the family's logit transform (LOGIT_TRANSFORMS), read from the config or, for multimodal
configs such as Gemma 3's, from its `text_config`. On CUDA with Liger-Kernel installed (the `gpu` extra), the
cross-entropy is Liger's fused linear cross-entropy instead of the chunked loop.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Families whose CausalLM head transforms logits after the output projection, keyed by the config
# attribute that turns it on. evaluate's `check_head` catches any family missing from this table.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": lambda x, cap: torch.tanh(x / cap) * cap,  # gemma2/3/4
    "logit_scale": lambda x, scale: x * scale,  # cohere
    "logits_scaling": lambda x, scale: x / scale,  # granite
}


def config_value(config, name):
    """config.<name>, else config.text_config.<name> (multimodal configs keep the language model's there)."""
    value = getattr(config, name, None)
    if value is None and getattr(config, "text_config", None) is not None:
        value = getattr(config.text_config, name, None)
    return value


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, d) final hidden states -> (B, T, V) float32 logits, as the model's own forward makes them."""
    logits = model.get_output_embeddings()(hidden).float()
    for name, transform in LOGIT_TRANSFORMS.items():
        value = config_value(model.config, name)
        if value is not None and not isinstance(value, bool):
            logits = transform(logits, float(value))
    return logits


def chunk_slices(rows: int, length: int, chunk_tokens: int) -> list[slice]:
    """Slices of the `length` positions of a (rows, length) batch, each about chunk_tokens tokens (at least one
    position): the head runs on one at a time, so peak memory grows with length, never with length x vocab."""
    step = max(1, chunk_tokens // rows)
    return [slice(s, s + step) for s in range(0, length, step)]


# ---- the loss: one implementation for training, the loop's evaluation, `retrofit eval` and distillation ----------

MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")  # what a batch may carry into the model's forward


def model_inputs(batch: dict) -> dict:
    """The model-input tensors a batch carries (input_ids; position_ids / attention_mask when present):
    position_ids carry packed documents (data/packing.py), whose mask transformers builds from their resets
    only with no attention_mask and no cache (use_cache=False)."""
    return {k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None}


def final_hidden(model, batch: dict) -> torch.Tensor:
    """(B, T) batch -> (B, T, d) final hidden states (after the final norm) through the model's own forward, so every
    wrapper's hooks run (FSDP2's all-gathers, DDP, PEFT, torch.compile); the head runs on one position only."""
    out = model(**model_inputs(batch), use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """labels shifted left with -100 at the end: position t is scored on token t+1 (no logits copied to shift)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def kl_per_position(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the last dim from log-probabilities (..., V) -> (...). A token the teacher
    rules out (log-probability -inf: a masked or padded vocabulary entry) adds 0, as 0 * log 0 = 0 says;
    exp(t) * (t - s) there is 0 * -inf = NaN (F.kl_div(log_target=True) too)."""
    diff = torch.where(teacher > float("-inf"), teacher - student, torch.zeros((), dtype=student.dtype))
    return (teacher.exp() * diff).sum(-1)


def _inner(model):
    return getattr(model, "module", model)  # DDP / accelerate wrappers: the head and config live inside


def _chunk_sum(model, hidden, teacher_hidden, labels, lm_weight: float, kl_weight: float, temperature: float):
    """One chunk's summed loss: (B, c, d) hidden states and (B, c) labels (-100 = not scored)."""
    logits = head_logits(model, hidden)  # (B, c, V): the only vocab-sized tensor
    total = logits.new_zeros(())
    if lm_weight:
        total = total + lm_weight * F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                    reduction="sum")
    if kl_weight:
        with torch.no_grad():
            teacher = torch.log_softmax(head_logits(model, teacher_hidden) / temperature, -1)  # (B, c, V)
        kl = kl_per_position(teacher, torch.log_softmax(logits / temperature, -1))  # (B, c)
        total = total + kl_weight * temperature ** 2 * (kl * (labels != -100)).sum()
    return total


def head_loss_sum(model, hidden: torch.Tensor, labels: torch.Tensor, *, teacher_hidden: torch.Tensor | None = None,
                  lm_weight: float = 1.0, kl_weight: float = 0.0, temperature: float = 1.0,
                  chunk_tokens: int = 1024) -> torch.Tensor:
    """Sum over scored positions of lm_weight * CE + kl_weight * T^2 * KL(teacher || student), float32, the head run
    on about chunk_tokens positions at a time. labels: (B, T) already shifted (position t scored on token t+1),
    -100 = not scored. Under autograd each chunk is checkpointed: its logits are recomputed in backward, so peak
    memory holds one chunk of logits (and its gradient), never (B, T, V). The same sum and gradients as the full
    computation: cross-entropy and KL are sums over positions, and a chunk's gradient is its own."""
    inner = _inner(model)
    fused = _fused_cross_entropy(inner, hidden, labels) if kl_weight == 0 and hidden.is_cuda else None
    if fused is not None:  # Liger's kernel on CUDA
        return lm_weight * fused
    B, T = labels.shape
    total = hidden.new_zeros((), dtype=torch.float32)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    # ZeRO-3 empties a parameter's storage after each module call and refills it before the module's backward, so a
    # recomputed chunk sees the frozen head weight (LoRA) empty, which checkpoint's metadata check takes for a
    # different tensor; the backward itself reads it refilled. Only that check is off, and only under ZeRO-3.
    check = "none" if _partitioned(inner.get_output_embeddings().weight) else "default"
    for part in chunk_slices(B, T, chunk_tokens):
        t_h = teacher_hidden[:, part] if teacher_hidden is not None else None
        args = (inner, hidden[:, part], t_h, labels[:, part], lm_weight, kl_weight, temperature)
        total = total + (checkpoint(_chunk_sum, *args, use_reentrant=False, determinism_check=check) if grad
                         else _chunk_sum(*args))
    return total


def _partitioned(weight) -> bool:
    """A DeepSpeed ZeRO-3 parameter (its tensor is a placeholder outside a gather; the module's hooks fill it)."""
    return hasattr(weight, "ds_id")


@torch.no_grad()
def head_token_scores(model, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 1024,
                      hits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T, d) hidden states and (B, T) shifted labels -> (B, T) float32 losses (0 where -100) and, with hits,
    (B, T) bool "the argmax is the label", the head run chunk by chunk (evaluation: no gradient, no recompute)."""
    inner = _inner(model)
    B, T = labels.shape
    losses = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(B, T, dtype=torch.bool, device=hidden.device) if hits else None
    for part in chunk_slices(B, T, chunk_tokens):
        logits = head_logits(inner, hidden[:, part])  # (B, c, V)
        target = labels[:, part]
        losses[:, part] = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                                          reduction="none").view(B, -1)
        if hits:
            correct[:, part] = logits.argmax(-1) == target
    return losses, correct


@functools.cache
def _liger():
    """Liger-Kernel's fused linear cross-entropy (the `gpu` extra) when importable, else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # not installed, or a Triton that cannot load
        return None
    return liger_fused_linear_cross_entropy


def _fused_cross_entropy(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """The summed cross-entropy by Liger's fused kernel (head projection and loss in one pass, no logits kept) on
    CUDA, or None where it does not apply: no CUDA, Liger not installed, a head bias, a transform other than
    soft-capping, or a head weight DeepSpeed ZeRO-3 partitions. Its parity with the chunked path is
    tests/train/test_chunked_loss.py's CUDA test."""
    if not hidden.is_cuda or _liger() is None:
        return None
    head = model.get_output_embeddings()
    values = {name: config_value(model.config, name) for name in LOGIT_TRANSFORMS}
    values = {name: v for name, v in values.items() if v is not None and not isinstance(v, bool)}
    if getattr(head, "bias", None) is not None or set(values) - {"final_logit_softcapping"}:
        return None
    if _partitioned(head.weight):  # ZeRO-3: outside the head's own call its weight is an empty placeholder; the
        return None                # chunked loss calls the head module, whose hooks gather the weight for it
    return _liger()(hidden.flatten(0, 1), head.weight, labels.flatten(), ignore_index=-100, reduction="sum",
                    softcap=values.get("final_logit_softcapping")).float()
