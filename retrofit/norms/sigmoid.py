"""sigmoid — sigmoid attention (Ramapuram et al., 2024): each key weighed on its own, no normalization across keys.

    a_ij = sigmoid(s_ij + b),   b = -log n_i  unless `bias` sets it   (n_i = keys query i sees)

Softmax ties a row's weights together (they sum to 1), so one key's weight falls as the context grows. Sigmoid
attention gives each key sigmoid(s + b) of its own: the weights need not sum to 1, and with b = -log n a row of
comparable logits sums to about 1 at initialization at any length (n sigmoid(s - log n) ~ e^s for s << log n), which
is what the paper found trains stably. A hidden key's weight is 0, and n counts what the mask leaves visible (a
sliding window of W keys: min(position + 1, W)).

Written on the weights-only path (weights_only.py): this file defines the weights; the forward, the masks, KV-cache
decoding, the refusal of a model's learned sinks, diagnose's weights and the vLLM refusal come from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register_norm
from .base import finite_number, option
from .weights_only import WeightsOnlyNorm


@register_norm
class Sigmoid(WeightsOnlyNorm):
    name = "sigmoid"
    summary = "sigmoid attention: each key weighed by sigmoid(s + b), no normalization across keys"
    formula = "a = sigmoid(s + b), b = -log n (n = keys the query sees) unless set"
    card = ("sigmoid attention weighs each key on its own, sigmoid(s + b), instead of sharing one unit of weight "
            "among all keys, so a key's weight does not shrink as the context grows; b = -log n keeps a row's total "
            "near 1 at initialization at every length.")
    diagnosis = ("weights sigmoid(l + b) are not normalized across keys and need not sum to 1: 1 reports the entropy "
                 "of the renormalized row; Corollary 1's bounds are softmax's and do not apply; 3 uses the weight "
                 "left outside the top-N set; 5 perturbs sigmoid(l / T + b), b unchanged.")

    @dataclass
    class Options:
        bias: float | None = option(None, "the logit bias b; null = -log n, n the keys the query sees",
                                    example=-2.0, elsewhere="a Linear layer's bias (logit_head.py, the loader)")

        def __post_init__(self):
            if self.bias is not None:
                self.bias = finite_number(self.bias, "sigmoid bias", " (null: -log of the keys each query sees)")

    def row_weights(self, scores: torch.Tensor, visible: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        bias = -torch.log(n) if self.options.bias is None else self.options.bias
        return torch.sigmoid(scores + bias)
