"""softmax — the unpatched baseline: weights = exp(s) / sum exp(s).

Calls the model's own kernel unchanged, so a model patched with `softmax` is bitwise identical to
the unpatched one. Useful as the control arm of an experiment (same code path, same parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import register_norm
from .base import Norm


@register_norm
class Softmax(Norm):
    name = "softmax"
    summary = "the unpatched baseline (bitwise identical to the original model)"
    formula = "a = exp(s) / sum_j exp(s_j)"
    baseline = True
    serve_as = "plain"  # vLLM's own attention, unchanged (a RoPE extension or NoPE alone)
    card = ("the unpatched baseline, published for comparison: softmax weights sum to 1, so as the context grows "
            "they spread out and each head's output variance falls roughly as 1/L (variance collapse).")
    diagnosis = "the paper's setting: every measure as defined."

    @dataclass
    class Options:
        pass

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        return base(module, query, key, value, attention_mask, **kwargs)
