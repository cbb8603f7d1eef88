"""ssmax — Scalable-Softmax (Nakanishi 2025): scale the logits by s_h * log n.

    a_i = softmax(s_h * log(n) * q.k_i * scale)

n is the number of keys that query may see: position + 1 under the causal mask, counting cached
keys while decoding and excluding padding — not the query length. s_h is a learned per-head scalar.
Its default initial value 1 / log(ref_len) makes the factor exactly 1 at `ref_len` (default: the
model's max positions), so a pretrained model is unchanged at that length. Implemented as a
per-query scaling of q followed by attention (`retrofit.kernels.ssmax_attention`): no T x T tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError
from ..kernels import ssmax_attention
from . import register_norm
from .base import Norm, kernel_call, option


@register_norm
class SSMax(Norm):
    name = "ssmax"
    summary = "Scalable-Softmax: logits times s*log(n), n = visible keys; s learned per head"
    formula = "a = softmax(s_h * log(n) * q.k / sqrt(d))"
    has_parameters = True

    @dataclass
    class Options:
        s_init: float | None = option(None, "initial s; default 1/log(ref_len) (factor exactly 1 at ref_len)")
        ref_len: int | None = option(None, "reference length for the default s_init; default the model's max positions")

        def __post_init__(self):
            if self.ref_len is not None and (not isinstance(self.ref_len, int) or self.ref_len < 2):
                raise RetrofitError(f"ssmax ref_len must be an integer >= 2, got {self.ref_len!r}")
            if self.s_init is not None:
                try:
                    self.s_init = float(self.s_init)
                except (TypeError, ValueError):
                    raise RetrofitError(f"ssmax s_init must be a number, got {self.s_init!r}") from None

    def __init__(self, options, shape):
        super().__init__(options, shape)
        ref_len = options.ref_len or shape.max_positions or 2048
        s_init = options.s_init if options.s_init is not None else 1.0 / math.log(ref_len)
        self.s = nn.Parameter(torch.full((shape.num_heads,), s_init))  # (H,)

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        return kernel_call(ssmax_attention, module, query, key, value, attention_mask, self.s, **kwargs)
