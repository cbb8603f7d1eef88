"""Identity-start schedules: each norm declares one knob (an option of its own) that is the original model at one
end and the full norm at the other; a schedule moves it while training.

    norm        knob    identity (start)          full norm (end)
    avnorm      floor   large (8; inf exact)      0
    psoftmax    p       1                         p (its gain follows: g^((p_now - 1) / (p - 1)))
    softmax1    sink    -30 (-inf exact)          sink (a fixed sink; a learnable one starts at `sink`)
    ssmax       blend   0                         1

The knob is a plain float on each norm module (softmax1: its sink buffer), set before every step from the step
alone (`apply_schedule`), so a resumed run is bitwise the uninterrupted one. At its end value every norm runs its
plain code path (bitwise the plain patch); after training the final value is written into config.retrofit's
options (`record_schedule`), so retrofit.from_pretrained rebuilds exactly what was trained.
Under train.compile a Python float that changes every step is a new guard value: expect a recompile per step
while the schedule moves (none after it ends).

The end need not be the plain norm: an avnorm floor may end at 1 or 2 (the last ablation's schedule collapsed where
the floor reached 0: f 8 -> 4 cost +0.06 nats zero-shot, f 2 -> 0 +0.58). shape=loss moves the knob in the loss's
units: given the zero-shot probe's losses c_0..c_k at evenly spaced positions of the straight path start -> end
(`costs`, as `retrofit patch --check-text FILE --schedule-values ... --schedule-end E` prints them, or measured
by the training setup on its first block: recovery.probe.schedule_costs; made
non-decreasing by a running max), the knob at progress u is where the piecewise-linear cost reaches
c_0 + u (c_k - c_0): equal cost per step, slow where the cost rises steeply. A flat curve falls back to linear.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from ..errors import RetrofitError
from ..norms import NORMS, Norm, make_options
from ..patching import CHILD
from ..record import read_record, set_option

SHAPES = ("linear", "cosine", "loss")


def scheduled_norms(model: nn.Module) -> list[Norm]:
    """The patch's norm modules in layer order; an error if the patch has no knob to schedule."""
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    if not norms:
        raise RetrofitError("recovery.schedule needs a patched model (no retrofit norm found)")
    cls = type(norms[0])
    if cls.scheduled_option is None:
        scheduled = ", ".join(f"{n} ({c.scheduled_option})" for n, c in sorted(NORMS.items()) if c.scheduled_option)
        raise RetrofitError(f"norm {cls.name!r} has no knob a schedule can move; norms with one: {scheduled}")
    return norms


def _progress(u: float, shape: str, costs=None) -> float:
    u = min(1.0, max(0.0, u))
    if shape == "loss":
        return loss_progress(u, costs)
    return u if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * u))


def loss_progress(u: float, costs) -> float:
    """Position s in [0, 1] along the straight path at which the probe's cost has risen by the fraction u of its
    total rise (see the module docstring); costs: losses at s = 0, 1/k, ..., 1. Non-decreasing in u."""
    if costs is None or len(costs) < 2:
        raise RetrofitError("schedule shape loss needs the zero-shot probe's costs (recovery.schedule.costs: at "
                            "least 2 losses at evenly spaced positions 0..1)")
    level = [float(costs[0])]
    for c in costs[1:]:
        level.append(max(level[-1], float(c)))  # a cost that dips (noise) is held at its running max
    rise = level[-1] - level[0]
    if not rise > 0:
        return u  # no cost to spread: linear
    target, k = level[0] + u * rise, len(level) - 1
    for i in range(k):
        if level[i + 1] >= target and level[i + 1] > level[i]:
            return (i + (target - level[i]) / (level[i + 1] - level[i])) / k
    return 1.0


def scheduled_value_at(t: float, start: float, end: float, shape: str = "linear", layer: int = 0, layers: int = 1,
            by_layer: bool = False, costs=None) -> float:
    """The knob at schedule position t in [0, 1] (0 = start, 1 = end). by_layer: layer i moves during
    [i / layers, (i + 1) / layers], first layer first. costs: shape=loss's probe losses."""
    u = t * layers - layer if by_layer else t
    if u >= 1.0:
        return end  # exactly the end value: the plain norm, bitwise (or the floor it ends at)
    if u <= 0.0:
        return start
    return start + (end - start) * _progress(u, shape, costs)


def endpoints(norm: Norm, start: float | None, end: float | None) -> tuple[float, float]:
    """(start, end) of `norm`'s knob, defaults filled in (the identity value; the patch's own option), each checked
    by the norm's own option rules (an avnorm floor < 0 is refused before any training)."""
    lo = norm.schedule_identity if start is None else start
    hi = getattr(norm.options, norm.scheduled_option) if end is None else end
    for key, value in (("start", lo), ("end", hi)):
        if not math.isfinite(value):
            raise RetrofitError(f"schedule start/end of {norm.name}'s {norm.scheduled_option} must be finite, "
                                f"got {lo} -> {hi}")
        try:
            make_options(norm.name, **{**dataclasses.asdict(norm.options), norm.scheduled_option: value})
        except RetrofitError as err:
            raise RetrofitError(f"recovery.schedule.{key} {value:g}: {err}") from None
    return lo, hi


def set_schedule_position(model: nn.Module, t: float, *, start: float | None = None, end: float | None = None,
                      shape: str = "linear", by_layer: bool = False, costs=None) -> list[float]:
    """Put every norm's knob at position t (0 = `start`, default the norm's identity value; 1 = `end`, default the
    patch's own option value). Returns the values set, one per norm."""
    if shape not in SHAPES:
        raise RetrofitError(f"schedule shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    norms = scheduled_norms(model)
    values = []
    for i, norm in enumerate(norms):
        lo, hi = endpoints(norm, start, end)
        value = scheduled_value_at(t, lo, hi, shape, i, len(norms), by_layer, costs)
        norm.set_scheduled_value(value)
        values.append(value)
    return values


def position_at(step: int, steps: int) -> float:
    """Schedule position before update `step` (0-based): 0 at step 0, 1 from step `steps` on."""
    return 1.0 if steps <= 0 else min(1.0, step / steps)


def apply_schedule(model: nn.Module, spec, step: int) -> list[float]:
    """Set the knobs for update `step` as `spec` (the recipe's recovery.schedule) says."""
    return set_schedule_position(model, position_at(step, spec.steps), start=spec.start, end=spec.end, shape=spec.shape,
                             by_layer=spec.by_layer, costs=spec.costs)


def scheduled_values(model: nn.Module) -> list[float]:
    return [n.scheduled_value() for n in scheduled_norms(model)]


def record_schedule(model: nn.Module) -> None:
    """Write the knob's final value into config.retrofit's options (what from_pretrained rebuilds)."""
    values = scheduled_values(model)
    if len(set(values)) != 1:
        raise RetrofitError(f"the schedule left layers at different knob values ({min(values)} .. {max(values)}); "
                            "set recovery.schedule.steps <= train.steps so it ends before the run does")
    norms = scheduled_norms(model)
    for norm in norms:  # psoftmax folds its gain's current power in: the recorded p alone rebuilds this model
        settle = getattr(norm, "settle_schedule", None)
        if settle is not None:
            settle()
    norm = norms[0]
    for m in model.modules():
        record = read_record(m.config) if hasattr(m, "config") else None
        if record is not None and "options" in record:
            set_option(m.config, norm.scheduled_option, values[0])


def is_patch_parameter(name: str) -> bool:
    """A parameter of the patch (a `retrofit` child), under any wrapper (PEFT's modules_to_save included)."""
    parts = name.split(".")
    return CHILD in parts[:-1] and "original_module" not in parts
