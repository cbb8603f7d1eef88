"""Retrofits that recover: start at the original model and move to the norm while training.

    with retrofit.patch_bypassed(model): teacher = model(ids)      # the same weights, attention as loaded
    set_schedule_position(model, 0.0, start=8.0)                        # avnorm floor 8: near the original
    apply_schedule(model, spec, step)                               # what the training loop calls every step
    kl_and_ce_sum(model, batch, kl_weight=1.0)                      # KL(teacher || student), chunked over positions
    head_spread(model, ids); schedule_losses(model, ids, [0, 0.5, 1])   # zero-shot probes (`patch --check-text`)

Modules: schedule (the knob each norm declares, moved from its identity value to the patch's), bypass (the
teacher), distill (chunked KL, attention-output matching), probe (losses along a schedule, per-head spread).
The recipe's `recovery` section (retrofit/recipe/recovery_section.py) documents every knob and what it trades off.
"""

from .bypass import patch_bypassed
from .distill import attention_outputs, chunked_kl_sum, kl_and_ce_sum, match_sum
from .probe import head_spread, schedule_losses
from .schedule import (
           apply_schedule,
           is_patch_parameter,
           record_schedule,
           scheduled_norms,
           scheduled_values,
           set_schedule_position,
)

__all__ = ["apply_schedule", "attention_outputs", "chunked_kl_sum", "head_spread", "is_patch_parameter",
           "kl_and_ce_sum", "schedule_losses", "scheduled_norms", "scheduled_values", "match_sum", "patch_bypassed",
           "record_schedule", "set_schedule_position"]
