"""psoftmax — p-softmax: normalize exp(s) by its Lp norm over the visible keys.

    a_i = exp(s_i) / (sum_j exp(p * s_j))^(1/p) = exp(s_i - LSE(p*s)/p)
    out_h = g_h^u * (A_h V_h),  u = (p_now - 1) / (p - 1)     only with `gain` set (a per-head output gain)

p = 1 is softmax (weights sum to 1); p = 2 is the L2-softmax of "Attention Normalizes the Wrong Norm":
sum_i a_i^2 = 1, so for uncorrelated unit-variance values the output variance ||a||_2^2 stays 1 at
any context length instead of shrinking like 1/n. Shift-invariant, so computed with the row max
subtracted; runs through `retrofit.kernels.psoftmax_attention` (exact, no T x T tensor).

On a pretrained model p > 1 multiplies each head's output by exp(LSE(s) - LSE(p*s)/p) >= 1, orders of magnitude
apart per head. `gain` adds a per-head output gain g_h (1-D, H values) that `retrofit.calibrate` sets to
mean RMS(softmax output) / mean RMS(p-softmax output), so the retrofit starts near the original function. A
recovery schedule moves p from 1 to `p` (the knob); the gain follows geometrically (g^0 = 1 at p = 1). When the
schedule ends elsewhere than `p`, `settle_schedule` makes the end the norm's own p and folds g^u into the gain, so a
reload (p = the end, full gain) is what was trained; with a gain, p = 1 has no schedule (u would divide by 0).

A model's own learned sinks (gpt_oss) are kept at p = 1 (softmax+1's kernel with the model's sink) and refused
for p != 1: the sink would join the p-norm, N = logaddexp(p N_p, p b_h) / p, and the kernels implement a sink
for p = 1 only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError
from ..kernels import psoftmax_attention, softmax1_attention
from . import register_norm
from .attention_call import kernel_call, model_sink
from .base import Norm, option, softmax_rows


@register_norm
class PSoftmax(Norm):
    name = "psoftmax"
    summary = "exp(s) normalized by its Lp norm (p=2: variance-preserving L2 softmax)"
    formula = "a = exp(s) / ||exp(s)||_p"
    scheduled_option, schedule_identity = "p", 1.0
    card = ("exp(s) is divided by its Lp norm instead of its sum; with p = 2 the squared weights sum to 1, so a head "
            "averaging L values keeps their variance at every length instead of collapsing as 1/L.")
    diagnosis = ("weights exp(s)/||exp(s)||_p do not sum to 1: 1 reports the entropy of the renormalized row and "
                 "Corollary 1 becomes n^(-1/p) e^(+-2a); 2: ||A||_2^2 = 1 at p = 2, so the prediction no longer "
                 "shrinks; 3 uses the weight left outside the top-N set where the paper has 1 - abar_N; 5 perturbs "
                 "exp(l/T)/||exp(l/T)||_p (Corollary 3's 1/(4T) is softmax's, Lemma 2 is the general bound).")
    example_options = {"p": 2.0}
    example_variants = ({"p": 3.0},)
    decode_target = 1.15  # two kernel calls per decoded token (bench decode; DESIGN: 11.2 vs 19.4 tok/s on CPU)
    calibration_hint = "psoftmax with gain=1 (--gain 1)"

    @dataclass
    class Options:
        p: float = option(2.0, "the norm's order, >= 1 (1 = softmax, 2 = L2 softmax)", example=3.0,
                          elsewhere="the order p of retrofit.kernels' psoftmax_attention, which the benchmarks sweep")
        gain: float | None = option(None, "initial per-head output gain (learned); retrofit.calibrate() sets it "
                                          "from text; null = no gain", example=0.5)

        def __post_init__(self):
            self.p = _p(self.p)
            if self.gain is not None:
                try:
                    self.gain = float(self.gain)
                except (TypeError, ValueError):
                    raise RetrofitError(f"psoftmax gain must be a number or null, got {self.gain!r}") from None

    def __init__(self, options, shape):
        super().__init__(options, shape)
        self.p = options.p  # the scheduled knob
        gain = None if options.gain is None else nn.Parameter(torch.full((shape.num_heads,), options.gain))
        self.register_parameter("gain", gain)  # (H,) or None
        self.calibration = None  # a list while retrofit.calibrate() collects statistics

    @classmethod
    def calibrates(cls, options) -> bool:
        return options.gain is not None

    def calibrated_parameter(self) -> str | None:
        return None if self.gain is None else "gain"

    def bound_terms(self) -> tuple[float, None]:
        return float(self.p), None

    def weights(self, logits: torch.Tensor, n: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return softmax_rows(logits / temperature, float(self.p))

    def set_scheduled_value(self, value: float) -> None:
        value = _p(value)
        if self.gain is not None and self.options.p == 1.0 and value != 1.0:
            raise RetrofitError(f"psoftmax p=1 with a gain cannot move its p to {value:g}: the gain follows "
                                "g^((p_now - 1) / (p - 1)), undefined at p = 1; set patch.p > 1 (the schedule's "
                                "target) or drop patch.gain or recovery.schedule")
        self.p = value

    def settle_schedule(self) -> None:
        """Make the knob's current value the norm's own p (what config.retrofit records after a schedule): the
        gain's current power g^u is written into the gain, so the forward is unchanged (bitwise for fp32 gains)
        and a model rebuilt with p = the knob's value computes exactly this one."""
        if self.gain is not None and self.p != self.options.p:
            with torch.no_grad():
                self.gain.copy_(self._gain_now())
        self.options = dataclasses.replace(self.options, p=self.p)  # a new object: options may be shared by layers

    def scheduled_value(self) -> float:
        return self.p

    @classmethod
    def serve_refusal(cls, options, heads: list[int] | None) -> str | None:
        return ("p-softmax is not served by vLLM: it rescales each row by exp(LSE(s) - LSE(p*s)/p) and vLLM's "
                "attention returns no log-sum-exp; run it with retrofit.from_pretrained or `retrofit eval`")

    @classmethod
    def sink_refusal(cls, options) -> str | None:
        if options.p != 1.0:
            return (f"psoftmax p={options.p:g} cannot keep the model's learned sinks (retrofit's kernels add a sink "
                    "for p = 1 only); use avnorm, ssmax or softmax1 with stack=True")
        return None

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        sink = model_sink(kwargs)
        if self.calibration is not None:  # observe only: RMS of the original and of the full p-softmax output
            out, weights = base(module, query, key, value, attention_mask, **kwargs)  # (B, T, H, D)
            y, _ = self.attend(module, query, key, value, attention_mask, self.options.p, sink, kwargs)
            self.calibration.append((out.float().pow(2).mean(-1).sqrt(), y.float().pow(2).mean(-1).sqrt()))
            return out, weights
        out, weights = self.attend(module, query, key, value, attention_mask, self.p, sink, kwargs)
        if self.gain is None:
            return out, weights
        return (out.float() * self._gain_now().view(-1, 1)).to(out.dtype), weights  # (B, T, H, D)

    def _gain_now(self) -> torch.Tensor:
        """The gain at the current p, fp32 (H,): g^u, u = (p_now - 1) / (p - 1): 0 at p = 1 (the original), 1 at p."""
        gain = self.gain.float()
        if self.p != self.options.p:  # mid-schedule (set_scheduled_value refuses this when options.p == 1)
            gain = gain.pow((self.p - 1.0) / (self.options.p - 1.0))
        return gain

    @staticmethod
    def attend(module, query, key, value, attention_mask, p: float, sink, kwargs):
        if sink is not None:  # p == 1 (patch refuses other p): softmax with the model's sink
            return kernel_call(softmax1_attention, module, query, key, value, attention_mask, sink, **kwargs)
        return kernel_call(psoftmax_attention, module, query, key, value, attention_mask, p, **kwargs)


def _p(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RetrofitError(f"psoftmax p must be a number >= 1, got {value!r}") from None
    if not (value >= 1) or math.isinf(value):
        raise RetrofitError(f"psoftmax p must be a finite number >= 1, got {value!r}")
    return value
