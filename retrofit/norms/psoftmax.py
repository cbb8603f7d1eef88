"""psoftmax — p-softmax: normalize exp(s) by its Lp norm over the visible keys.

    a_i = exp(s_i) / (sum_j exp(p * s_j))^(1/p) = exp(s_i - LSE(p*s)/p)

p = 1 is softmax (weights sum to 1); p = 2 is the L2-softmax of "Attention Normalizes the Wrong Norm":
sum_i a_i^2 = 1, so for uncorrelated unit-variance values the output variance ||a||_2^2 stays 1 at
any context length instead of shrinking like 1/n. Shift-invariant, so computed with the row max
subtracted; runs through `retrofit.kernels.psoftmax_attention` (exact, no T x T tensor).

A model's own learned sinks (gpt_oss) are kept at p = 1 (softmax+1's kernel with the model's sink) and refused
for p != 1: the sink would join the p-norm, N = logaddexp(p N_p, p b_h) / p, and the kernels implement a sink
for p = 1 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import RetrofitError
from ..kernels import psoftmax_attention, softmax1_attention
from . import register_norm
from .base import Norm, kernel_call, model_sink, option


@register_norm
class PSoftmax(Norm):
    name = "psoftmax"
    summary = "exp(s) normalized by its Lp norm (p=2: variance-preserving L2 softmax)"
    formula = "a = exp(s) / ||exp(s)||_p"

    @dataclass
    class Options:
        p: float = option(2.0, "the norm's order, >= 1 (1 = softmax, 2 = L2 softmax)")

        def __post_init__(self):
            try:
                self.p = float(self.p)
            except (TypeError, ValueError):
                raise RetrofitError(f"psoftmax p must be a number >= 1, got {self.p!r}") from None
            if not (self.p >= 1) or math.isinf(self.p):
                raise RetrofitError(f"psoftmax p must be a finite number >= 1, got {self.p!r}")

    @classmethod
    def sink_refusal(cls, options) -> str | None:
        if options.p != 1.0:
            return (f"psoftmax p={options.p:g} cannot keep the model's learned sinks (retrofit's kernels add a sink "
                    "for p = 1 only); use avnorm, ssmax or softmax1 with stack=True")
        return None

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        sink = model_sink(kwargs)
        if sink is not None:  # p == 1 (patch refuses other p): softmax with the model's sink
            return kernel_call(softmax1_attention, module, query, key, value, attention_mask, sink, **kwargs)
        return kernel_call(psoftmax_attention, module, query, key, value, attention_mask, self.options.p, **kwargs)
