"""The recipe's optional `recovery` section: how a retrofit recovers the original model's function (an identity-start
schedule of the norm's knob, distillation from the bypassed teacher, output matching), every key off by default.

    recovery:
      schedule: {steps: 200, shape: cosine}   # avnorm floor 8 -> 0 over 200 steps
      kl_weight: 0.2                          # pull toward the original model's next-token distribution

Registered with register_section (recipe/__init__.py); retrofit.recovery does what the keys ask (the schedules, the
bypassed teacher, chunked KL, output matching).
Wrong types and impossible values fail in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from .schema import require, setting


@dataclass
class ScheduleSection:
    steps: int = setting(0, "steps over which the knob moves from start to end (then stays at end); more = gentler, "
                            "the model adapts while the norm arrives; must be <= train.steps")
    start: float | None = setting(None, "the knob at step 0; null = the norm's identity value (the original model): "
                                        "avnorm floor 8, psoftmax p 1, softmax1 sink -30, ssmax blend 0")
    end: float | None = setting(None, "the knob from `steps` on; null = the patch's own value (avnorm floor 0, "
                                      "psoftmax p, softmax1 sink, ssmax blend 1): the plain norm, bitwise")
    shape: Literal["linear", "cosine", "loss"] = setting("linear", "linear, cosine (slow at both ends), or loss: "
                                                                  "equal zero-shot cost per step (slow where the "
                                                                  "probe's loss rises steeply; needs costs)")
    by_layer: bool = setting(False, "move one layer at a time, first layer first, each over steps / layers; the "
                                    "later layers adapt to an already-changed input")
    costs: list[float] | None = setting(None, "shape loss: the zero-shot probe's losses at evenly spaced positions "
                                              "0..1 of the straight path start -> end, as `retrofit patch MODEL --norm "
                                              "N --check-text FILE --schedule-values 0,0.25,0.5,0.75,1 --schedule-end "
                                              "E` prints them; null = measured as the run starts (task lm: the first "
                                              "training block at 9 positions, printed; pin them here for a resume "
                                              "that must be exact on a GPU)")

    def __post_init__(self):
        require(self.steps >= 1, f"recovery.schedule.steps must be >= 1, got {self.steps}")
        for key in ("start", "end"):
            value = getattr(self, key)
            require(value is None or math.isfinite(value), f"recovery.schedule.{key} must be finite, got {value}")
        if self.shape != "loss":
            require(self.costs is None, f"recovery.schedule.costs shape the schedule in the loss's units: set shape: "
                                     f"loss, or drop costs (shape is {self.shape})")
            return
        require(self.costs is None or len(self.costs) >= 2,
             "recovery.schedule.shape loss needs costs: at least 2 zero-shot probe losses at evenly spaced positions "
             "0..1 (retrofit patch ... --check-text FILE --schedule-values 0,0.25,0.5,0.75,1 prints them), or null "
             "to measure them as the run starts")
        require(all(math.isfinite(c) for c in self.costs or ()), f"recovery.schedule.costs must be finite, got "
                                                              f"{self.costs}")
        require(not self.by_layer, "recovery.schedule.shape loss spreads the whole model's probe cost; by_layer moves "
                                "one layer at a time, which the probe did not measure: drop one of them")


@dataclass
class RecoverySection:
    """How a retrofit recovers the original model's function; every key defaults to off."""

    renamed: ClassVar[dict] = {"calibrate": "calibrate_tokens"}  # old key -> its name now (saved runs still load)
    schedule: ScheduleSection | None = setting(None, "identity-start schedule of the norm's knob (avnorm floor, "
                                                     "psoftmax p, softmax1 sink, ssmax blend); null = the full norm "
                                                     "from step 0")
    lm_weight: float = setting(1.0, "weight of the next-token loss on the data; 0 = pure distillation")
    kl_weight: float = setting(0.0, "weight of KL(teacher || student) per token, teacher = the same weights with the "
                                    "patch bypassed (norm, RoPE extension and LoRA adapters off): pulls toward the "
                                    "original function, one extra forward. Exact while the base is frozen "
                                    "(freeze_base, train.peft); a full finetune moves the teacher too, so keep the "
                                    "weight small (0.1-0.3) there")
    kl_temperature: float = setting(1.0, "softens both distributions (loss scaled by T^2); > 1 also matches the tail")
    chunk_tokens: int = setting(1024, "positions x rows per chunk of the output head in the KL; smaller = less memory "
                                      "(never L x vocab at once), more head calls")
    match_steps: int = setting(0, "first stage: for these steps, match each layer's attention output (the output "
                                  "projection's input) to the teacher's by MSE, training only the patch's parameters")
    patch_lr: float | None = setting(None, "peak learning rate of the patch's own parameters (gains, sinks, s); "
                                           "null = train.lr. New parameters tolerate (and need) a larger one")
    patch_warmup_steps: int | None = setting(None, "warmup of patch_lr; null = train.warmup_steps")
    freeze_base: bool = setting(False, "train only the patch's parameters (cheap, keeps the model; limited recovery); "
                                       "patch + LoRA: train.peft with train_patch: true instead")
    calibrate_tokens: int | None = setting(None, "tokens to calibrate psoftmax's per-head gain (patch.gain set) on; "
                                                 "null = 8192 on a pretrained model; 0 = off (avnorm uses "
                                                 "patch.calibrate_tokens)")

    def __post_init__(self):
        for key in ("lm_weight", "kl_weight"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"recovery.{key} must be >= 0, got {value}")
        require(self.lm_weight > 0 or self.kl_weight > 0,
                "recovery: lm_weight and kl_weight are both 0: nothing to train")
        require(self.kl_temperature > 0, f"recovery.kl_temperature must be > 0, got {self.kl_temperature}")
        require(self.chunk_tokens >= 1, f"recovery.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        require(self.match_steps >= 0, f"recovery.match_steps must be >= 0, got {self.match_steps}")
        require(self.patch_lr is None or (math.isfinite(self.patch_lr) and self.patch_lr >= 0),
             f"recovery.patch_lr must be >= 0, got {self.patch_lr}")
        require(self.patch_warmup_steps is None or self.patch_warmup_steps >= 0,
             f"recovery.patch_warmup_steps must be >= 0, got {self.patch_warmup_steps}")
        require(self.calibrate_tokens is None or self.calibrate_tokens >= 0,
             f"recovery.calibrate_tokens must be >= 0, got {self.calibrate_tokens}")

    def distills(self) -> bool:
        return self.kl_weight > 0 or self.match_steps > 0
