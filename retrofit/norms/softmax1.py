"""softmax1 — softmax+1 ("attention is off by one"): a sink logit in the denominator.

    a_i = exp(s_i) / (exp(b_h) + sum_j exp(s_j)),  computed as exp(s_i - m) / (exp(b_h - m) + sum_j exp(s_j - m))

with m = max(b_h, max_j s_j) so the "+1" never overflows or vanishes. b_h = `sink` (default 0, the classic +1);
`learnable: true` makes b_h a learned per-head logit (init `sink`). b_h -> -inf is the original softmax
(b_h = -30 is within 1e-6 of it): a retrofit starts there, as a recovery schedule of the fixed sink from a very
negative value up to `sink`, or as a learned sink initialized very negative (`sink: -20, learnable: true`).
On a model that has learned sinks of its own (gpt_oss) this is a second sink: refused unless `stack: true`, which
adds both to the denominator, exp(b_h) + exp(b_model) = exp(logaddexp(b_h, b_model)).
The weights may sum to less than 1, so a head can attend to nothing. As an LSE rescale of softmax attention:
out = softmax_out * sigmoid(LSE(s) - b_h) (`retrofit.kernels.softmax1_attention`): no T x T tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError
from ..kernels import softmax1_attention
from . import register_norm
from .attention_call import kernel_call, model_sink
from .base import Norm, finite_number, option


@register_norm
class Softmax1(Norm):
    name = "softmax1"
    summary = "softmax+1: a (optionally learned) sink logit in the denominator"
    formula = "a = exp(s) / (exp(b_h) + sum_j exp(s_j)), b_h = 0 or learned"
    scheduled_option, schedule_identity = "sink", -30.0
    per_head = True  # heads= selects heads; the others keep plain softmax, no sink (patch: Norm.keep_unselected)
    card = ("softmax+1 puts a sink in the denominator, so a head can attend to nothing rather than being forced to "
            "spread its weight over irrelevant tokens of a long context.")
    diagnosis = ("weights exp(s)/(exp(b)+sum exp(s)) sum to less than 1 (the sink takes the rest): 1 reports the "
                 "entropy of the renormalized row and the sink-aware Corollary 1 bounds; 3 uses the weight left "
                 "outside the top-N set; 5 divides the sink logit by T too.")
    example_options = {"learnable": True}
    example_variants = ({"learnable": False},)  # a fixed sink
    serve_as = "sinks"  # vLLM: b_h as its attention's sinks (exp(b_h) in every row's denominator is softmax+1)

    @dataclass
    class Options:
        learnable: bool = option(False, "learn a per-head sink logit b_h (init `sink`) instead of a fixed one")
        sink: float = option(0.0, "the sink logit b_h (learnable: its initial value); very negative = the original "
                                  "softmax, 0 = softmax+1", example=-1.0)
        stack: bool = option(False, "allow on models with learned sinks of their own (gpt_oss): both sinks count")

        def __post_init__(self):
            if not isinstance(self.stack, bool):
                raise RetrofitError(f"softmax1 stack must be true or false, got {self.stack!r}")
            if isinstance(self.learnable, str) or not isinstance(self.learnable, (bool, int)):
                raise RetrofitError(f"softmax1 learnable must be true or false, got {self.learnable!r}")
            self.learnable = bool(self.learnable)
            self.sink = _sink(self.sink)

    def __init__(self, options, shape):
        super().__init__(options, shape)
        sink = torch.full((shape.num_heads,), options.sink)  # (H,)
        if options.learnable:
            self.sink = nn.Parameter(sink)
        else:
            self.register_buffer("sink", sink, persistent=False)

    def set_scheduled_value(self, value: float) -> None:
        if self.options.learnable:
            raise RetrofitError("softmax1 with learnable: true learns its sink (start it very negative with "
                                "sink: -20); a schedule moves only a fixed sink")
        self.sink.fill_(_sink(value))

    def scheduled_value(self) -> float:
        return float(self.sink[0])

    @classmethod
    def sink_note(cls, options) -> str:
        return "stacked with softmax1's sink"

    def bound_terms(self) -> tuple[float, torch.Tensor]:
        return 1.0, self.sink.detach().float().view(-1, 1)

    def weights(self, logits: torch.Tensor, n: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """exp(l / T) / (exp(b_h / T) + sum exp(l / T)), shifted by the row's max (the sink counted in it)."""
        logits = logits / temperature
        sink = (self.sink.detach().to(logits.dtype).view(-1, 1, 1) / temperature).expand_as(logits[..., :1])
        m = torch.maximum(logits.amax(-1, keepdim=True), sink)
        e = torch.exp(logits - m)
        return e / (torch.exp(sink - m) + e.sum(-1, keepdim=True))

    @classmethod
    def sink_refusal(cls, options) -> str | None:
        if not options.stack:
            return "softmax1 would add a second sink to the model's own learned sinks: pass stack=True to combine them"
        return None

    @classmethod
    def serve_refusal(cls, options, heads: list[int] | None) -> str | None:
        if heads is not None:  # vLLM's sinks are every head's: unselected heads would get one too
            return ("retrofit's vLLM plugin does not serve softmax1 on selected heads (heads=) yet: run it with "
                    "retrofit.from_pretrained")
        return None

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        sink = self.sink  # (H,)
        theirs = model_sink(kwargs)
        if theirs is not None:  # stack=True (patch refuses otherwise): both sinks in the denominator
            sink = torch.logaddexp(sink.to(theirs.dtype), theirs)
        return kernel_call(softmax1_attention, module, query, key, value, attention_mask, sink, **kwargs)


def _sink(value) -> float:
    return finite_number(value, "softmax1 sink", " (-30 is the original softmax to 1e-6)")
