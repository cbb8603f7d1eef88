"""The path for a norm that defines only its weights: subclass WeightsOnlyNorm and write `row_weights`.

    @register_norm
    class Sigmoid(WeightsOnlyNorm):
        name, summary, formula = "sigmoid", "...", "a = sigmoid(s + b)"
        def row_weights(self, scores, visible, n):       # (B, H, R, K) scores, -inf where `visible` is False;
            return torch.sigmoid(scores + ...)           # n (B, H, R, 1) keys each row sees

Everything else comes from here and from retrofit.kernels.weights_attention, which every such norm shares:
- the forward: transformers' attention call read as its sdpa path reads it (attention_call.kernel_call: the visible
  keys of a KV cache or a static cache, the padding and sliding-window masks, position bias, soft-capping, dropout
  in training), row blocks of O(T) memory, forward and backward, gradients by autograd through the formula on one
  block at a time (the norm's parameters' too);
- the masks: a hidden key's weight is 0 whatever the formula gives, and n counts the keys a row sees, from the same
  block masks the other kernels use (kernels/masks.py);
- KV-cache decoding: the same call with one query row;
- the model's own learned sinks (gpt_oss) refused at patch time in one line (sink_refusal);
- diagnose's weights hook: `weights(logits, n, temperature)` is row_weights on logits / temperature, so the weights
  diagnose rebuilds are the ones the forward uses;
- vLLM refused in one line (serve_refusal): its attention computes softmax's weights only.
"""

from __future__ import annotations

import torch

from ..kernels import weights_attention
from .attention_call import kernel_call
from .base import Norm


class WeightsOnlyNorm(Norm):
    """A norm given by its weights alone: w = row_weights(scores, visible, n) for each query row."""

    def row_weights(self, scores: torch.Tensor, visible: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Weights (B, H, R, K) from scores (B, H, R, K) (scale * q.k plus any mask bias; -inf on hidden keys),
        `visible` (bool, same shape) and n (B, H, R, 1) visible keys per row, >= 1. Hidden keys' weights are set to 0
        afterwards. Computed in fp32 (fp64 for fp64 inputs); must be differentiable in the scores."""
        raise NotImplementedError

    def weights(self, logits: torch.Tensor, n: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        visible = ~torch.isneginf(logits)
        return torch.where(visible, self.row_weights(logits / temperature, visible, n.to(logits.dtype)), 0.0)

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        params = tuple(p for p in self.parameters() if p.requires_grad)  # what row_weights may read: its gradients
        return kernel_call(weights_attention, module, query, key, value, attention_mask, self.row_weights, params,
                           **kwargs)

    @classmethod
    def sink_refusal(cls, options) -> str | None:
        return (f"{cls.name} defines its weights only and would drop the model's learned attention sinks; use a norm "
                "that keeps them (avnorm, ssmax, softmax1 with stack=True)")

    @classmethod
    def serve_refusal(cls, options, heads: list[int] | None) -> str | None:
        return (f"{cls.name} is not served by vLLM: its weights are not softmax's and vLLM's attention computes "
                "softmax only; run it with retrofit.from_pretrained or `retrofit eval`")
