"""Distillation from the original model (the teacher is the patch bypassed: retrofit.recovery.bypass).

    loss = lm_weight * CE(student) + kl_weight * KL(teacher || student)      kl_and_ce_sum, summed over tokens
    loss = sum_layers ||o_student - o_teacher||^2 / ||o_teacher||^2          match_sum: each attention output

Memory: the body runs once per model and returns final hidden states (B, T, d); the output head runs on
`chunk_tokens` positions at a time inside a checkpoint (recomputed in backward), so no L x V logits ever exist,
forward or backward. Sums, not means: the training loop divides by the global item count.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import RetrofitError
from ..logit_head import chunk_slices, head_logits
from ..patch import attention_modules, output_projection
from .bypass import patch_bypassed


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP / accelerate wrappers


def final_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T, d) final hidden states, through the model's own (wrapped) forward; one head position."""
    out = model(input_ids=input_ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


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


def kl_per_position(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the last dim from log-probabilities (..., V) -> (...). A token the teacher
    rules out (log-probability -inf: a masked or padded vocabulary entry) adds 0, as 0 * log 0 = 0 says;
    exp(t) * (t - s) there is 0 * -inf = NaN (F.kl_div(log_target=True) too)."""
    diff = torch.where(teacher > float("-inf"), teacher - student, torch.zeros((), dtype=student.dtype))
    return (teacher.exp() * diff).sum(-1)


def _chunk_terms(model, student_h, teacher_h, labels, lm_weight: float, kl_weight: float, temperature: float):
    """One chunk's summed loss: (B, c, d) hidden states and (B, c) labels (-100 = not scored)."""
    logits = head_logits(_inner(model), student_h)  # (B, c, V)
    valid = labels != -100
    total = logits.new_zeros(())
    if lm_weight:
        total = total + lm_weight * F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                    reduction="sum")
    if kl_weight:
        with torch.no_grad():
            teacher = torch.log_softmax(head_logits(_inner(model), teacher_h) / temperature, -1)  # (B, c, V)
        kl = kl_per_position(teacher, torch.log_softmax(logits / temperature, -1))  # (B, c)
        total = total + kl_weight * temperature ** 2 * (kl * valid).sum()
    return total


def chunked_kl_sum(model, student_h: torch.Tensor, teacher_h: torch.Tensor | None, labels: torch.Tensor, *,
                   lm_weight: float = 0.0, kl_weight: float = 1.0, temperature: float = 1.0,
                   chunk_tokens: int = 1024) -> torch.Tensor:
    """Sum over scored positions of lm_weight * CE + kl_weight * KL(teacher || student), head run in chunks.
    labels: (B, T) already shifted (position t scored on token t+1), -100 = not scored."""
    B, T = labels.shape
    total = student_h.new_zeros((), dtype=torch.float32)
    for part in chunk_slices(B, T, chunk_tokens):
        t_h = teacher_h[:, part] if teacher_h is not None else student_h.new_zeros(())
        args = (model, student_h[:, part], t_h, labels[:, part], lm_weight, kl_weight, temperature)
        if torch.is_grad_enabled() and student_h.requires_grad:  # recomputed in backward: no L x V saved
            total = total + checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            total = total + _chunk_terms(*args)
    return total


def kl_and_ce_sum(model: nn.Module, batch: dict, *, lm_weight: float = 1.0, kl_weight: float = 1.0,
                  temperature: float = 1.0, chunk_tokens: int = 1024) -> torch.Tensor:
    """The student's lm loss mixed with KL from the teacher (the same model, patch bypassed), summed over items."""
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # position t scored on token t+1
    teacher_h = None
    if kl_weight:
        with teacher_mode(model):
            teacher_h = final_hidden(model, batch["input_ids"])
    student_h = final_hidden(model, batch["input_ids"])
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
    ids = batch["input_ids"]
    with teacher_mode(model), attention_outputs(model) as teacher:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    with attention_outputs(model) as student:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    valid = (batch["labels"] != -100).float()[..., None] if "labels" in batch else torch.ones_like(ids)[..., None]
    total = student[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student, teacher):
        scale = t.float().pow(2).mean().clamp_min(1e-12)
        total = total + ((s.float() - t.float()).pow(2).mean(-1, keepdim=True) * valid).sum() / scale
    return total / max(1, len(student))
