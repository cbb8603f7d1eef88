"""Distillation from the original model (the teacher is the patch bypassed: retrofit.recovery.bypass).

    loss = lm_weight * CE(student) + kl_weight * KL(teacher || student)      kl_and_ce_sum, summed over tokens
    loss = sum_layers ||o_student - o_teacher||^2 / ||o_teacher||^2          match_sum: each attention output

Memory: the body runs once per model and returns final hidden states (B, T, d); the loss is logit_head's
head_loss_sum (the one chunked loss training uses too): the output head runs on `chunk_tokens` positions at a
time inside a checkpoint (recomputed in backward), so no L x V logits ever exist, forward or backward. Sums, not
means: the training loop divides by the global item count.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..attention_modules import attention_modules
from ..errors import RetrofitError
from ..logit_head import final_hidden, head_logits, head_loss_sum, kl_per_position, model_inputs, next_tokens  # noqa: F401
from ..patching import output_projection
from .bypass import patch_bypassed


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP / accelerate wrappers


@contextlib.contextmanager
def teacher_mode(model: nn.Module):
    """The teacher: the patch bypassed, LoRA adapters disabled (PEFT), no dropout, no gradient. It is the original
    model exactly while the base weights are frozen (recovery.freeze_base, or train.peft); a full finetune moves
    those weights, and the teacher with them."""
    was = model.training
    inner = _inner(model)
    adapters = inner.disable_adapter() if hasattr(inner, "disable_adapter") else contextlib.nullcontext()
    model.eval()  # no dropout in the teacher
    try:
        with patch_bypassed(model), adapters, torch.no_grad():
            yield
    finally:
        model.train(was)


def chunked_kl_sum(model, student_h: torch.Tensor, teacher_h: torch.Tensor | None, labels: torch.Tensor, *,
                   lm_weight: float = 0.0, kl_weight: float = 1.0, temperature: float = 1.0,
                   chunk_tokens: int = 1024) -> torch.Tensor:
    """Sum over scored positions of lm_weight * CE + kl_weight * KL(teacher || student): logit_head.head_loss_sum,
    the one chunked loss, with distillation's defaults. labels: (B, T) already shifted, -100 = not scored."""
    return head_loss_sum(model, student_h, labels, teacher_hidden=teacher_h, lm_weight=lm_weight,
                         kl_weight=kl_weight, temperature=temperature, chunk_tokens=chunk_tokens)


def kl_and_ce_sum(model: nn.Module, batch: dict, *, lm_weight: float = 1.0, kl_weight: float = 1.0,
                  temperature: float = 1.0, chunk_tokens: int = 1024) -> torch.Tensor:
    """The student's lm loss mixed with KL from the teacher (the same model, patch bypassed), summed over items."""
    labels = next_tokens(batch["labels"])  # position t scored on token t+1
    teacher_h = None
    if kl_weight:
        with teacher_mode(model):
            teacher_h = final_hidden(model, batch)
    student_h = final_hidden(model, batch)
    return chunked_kl_sum(model, student_h, teacher_h, labels, lm_weight=lm_weight, kl_weight=kl_weight,
                          temperature=temperature, chunk_tokens=chunk_tokens)


def output_projections(model: nn.Module) -> list[nn.Module]:
    """Each attention module's output projection (its input is the attention output, heads concatenated)."""
    found = []
    for name, module in attention_modules(_inner(model)):
        proj = output_projection(module)
        if proj is None:
            raise RetrofitError(f"cannot find the output projection of {name}: output matching does not support "
                                "this family (add its name to families.OUTPUT_PROJECTIONS)")
        found.append(proj)
    return found


@contextlib.contextmanager
def attention_outputs(model: nn.Module):
    """Collect every layer's attention output (the output projection's input, (B, T, H*D)) into a list."""
    captured: list[torch.Tensor] = []
    hooks = [p.register_forward_pre_hook(lambda _m, args: captured.append(args[0])) for p in output_projections(model)]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def match_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over layers and tokens of ||o_student - o_teacher||^2 / mean ||o_teacher||^2 (scale-free per layer)."""
    ids, inputs = batch["input_ids"], model_inputs(batch)
    with teacher_mode(model), attention_outputs(model) as teacher:
        model(**inputs, use_cache=False, logits_to_keep=1)
    with attention_outputs(model) as student:
        model(**inputs, use_cache=False, logits_to_keep=1)
    valid = (batch["labels"] != -100).float()[..., None] if "labels" in batch else torch.ones_like(ids)[..., None]
    total = student[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student, teacher):
        scale = t.float().pow(2).mean().clamp_min(1e-12)
        total = total + ((s.float() - t.float()).pow(2).mean(-1, keepdim=True) * valid).sum() / scale
    return total / max(1, len(student))
