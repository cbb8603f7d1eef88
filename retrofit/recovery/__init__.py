"""Retrofits that recover (issue #14): start at the original model and move to the norm while training.

    with retrofit.patch_bypassed(model): teacher = model(ids)      # the same weights, attention as loaded
    set_knob_position(model, 0.0, start=8.0)                        # avnorm floor 8: near the original
    apply_schedule(model, spec, step)                               # what the training loop calls every step
    kl_and_ce_sum(model, batch, kl_weight=1.0)                      # KL(teacher || student), chunked over positions
    head_spread(model, ids); knob_losses(model, ids, [0, 0.5, 1])   # zero-shot probes (`retrofit patch --check-text`)

Modules: schedule (the knob each norm declares, moved from its identity value to the patch's), bypass (the
teacher), distill (chunked KL, attention-output matching), probe (losses along a schedule, per-head spread).
The recipe's `recovery` section (retrofit/recipe/sections.py) documents every knob and what it trades off.
"""

from .bypass import patch_bypassed
from .distill import attention_outputs, chunked_kl_sum, kl_and_ce_sum, match_sum
from .probe import head_spread, knob_losses
from .schedule import apply_schedule, is_patch_parameter, knob_norms, knob_values, record_knob, set_knob_position

__all__ = ["apply_schedule", "attention_outputs", "chunked_kl_sum", "head_spread", "is_patch_parameter",
           "kl_and_ce_sum", "knob_losses", "knob_norms", "knob_values", "match_sum", "patch_bypassed",
           "record_knob", "set_knob_position"]
