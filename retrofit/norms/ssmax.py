"""ssmax — Scalable-Softmax (Nakanishi 2025): scale the logits by a function of n, the visible keys.

    retrofit.patch(model, "ssmax")                    # scale=learned: s_h * log n, s learned per head
    retrofit.patch(model, "ssmax", scale="beyond")    # max(1, log n / log L): the original model inside L
    retrofit.patch(model, "ssmax", scale="llama4")    # 1 + beta * log(1 + floor((n - 1) / L)): also 1 inside L

    learned:  a_i = softmax(s_h * log(n) * q.k_i * scale)
    beyond:   a_i = softmax(max(1, log n / log L) * q.k_i * scale)          (Qwen's log-n form)
    llama4:   a_i = softmax((1 + beta * log(1 + floor((n - 1) / L))) * q.k_i * scale)

n is the number of keys that query may see: position + 1 under the causal mask, counting cached
keys while decoding and excluding padding — not the query length. L (`ref_len`) defaults to the model's
ORIGINAL positions: with `rope=` extending the context, the max_position_embeddings from before the patch.

learned: s_h's default initial value 1 / log(L) makes the factor exactly 1 at n = L, so a pretrained model
is unchanged at that length (only there). Runs `retrofit.kernels.ssmax_attention`: no T x T tensor.

beyond and llama4 have no parameters and are exactly 1.0 for every n <= L, so every query at a position
< L is bitwise the original's (multiplying by 1.0 is exact); they scale q per query row and then call the
wrapped base kernel (sdpa, or the model's eager with its soft-capping), whatever it is. llama4 is the
floored form of Llama 4's attention temperature as Ministral 3 indexes it (floor(position / L),
transformers' `get_llama_4_attn_scale`), which starts at position L; Llama 4 itself uses
floor((position + 1) / floor_scale), which already scales position floor_scale - 1.
Models that already scale queries by position (Llama 4, Ministral 3) are refused unless stack=True.

blend (alpha) mixes the factor with 1: f_alpha(n) = 1 + alpha * (f(n) - 1). alpha = 1 is SSMax (the same code,
bitwise); alpha = 0 is exactly the original model. A recovery schedule moves alpha from 0 to `blend`; between,
the blended factor scales q and the wrapped base kernel runs (s still learns through it).
A model's own learned sinks (gpt_oss) are kept: beyond and llama4 call its eager function, which applies them;
learned scales q as above and runs softmax+1's kernel with the model's sink (a sink is no q.k logit: unscaled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError, closest
from ..kernels import softmax1_attention, ssmax_attention
from ..kernels.masks import visible_counts
from . import register_norm
from .attention_call import kernel_call, model_sink, visible_keys
from .base import Norm, option

SCALES = ("learned", "beyond", "llama4")


@register_norm
class SSMax(Norm):
    name = "ssmax"
    summary = "Scalable-Softmax: logits times a function of n = visible keys (learned s*log n, or 1 inside L)"
    formula = "a = softmax(f(n) * q.k / sqrt(d)); f = s_h*log n | max(1, log n/log L) | 1 + beta*log(1+floor((n-1)/L))"
    scales_queries_by_position = True
    serve_as = "queries"  # vLLM: q times logit_factor(n), n = position + 1 (vLLM packs sequences: no padding)
    scheduled_option, schedule_identity = "blend", 0.0
    per_head = True  # heads= selects heads; the others keep plain softmax logits (patch: Norm.keep_unselected)
    card = ("Scalable-Softmax multiplies the logits by s*log(n) (n = keys the query sees), so attention stays as "
            "peaked over many keys as over few, instead of flattening as the context grows.")
    diagnosis = ("weights are softmax(s log(n) l): L enters theta, so Lemma 1's premise fails by design; Corollary 1 "
                 "is applied to the effective logits (a -> s log(n) a); 5 perturbs the logits l before the s log(n) "
                 "factor, so T = 1 is the model as it is.")

    @dataclass
    class Options:
        scale: str = option("learned", "learned (s_h*log n) | beyond (max(1, log n/log L)) | llama4 (floored)",
                            example="beyond")
        s_init: float | None = option(None, "learned: initial s; default 1/log(ref_len) (factor exactly 1 there)",
                                      example=0.3)
        ref_len: int | None = option(None, "L: default the model's original max positions (before rope=)", example=16)
        beta: float | None = option(None, "llama4: strength; default 0.1 (Llama 4's attn_scale)",
                                    example={"scale": "llama4", "beta": 0.2})
        stack: bool = option(False, "allow on models that already scale queries by position (Llama 4)")
        blend: float = option(1.0, "alpha in factor 1 + alpha * (f(n) - 1): 0 = the original model, 1 = SSMax",
                              example=0.5)

        def __post_init__(self):
            if self.scale not in SCALES:
                raise RetrofitError(f"ssmax scale must be one of {', '.join(SCALES)}, got {self.scale!r}"
                                    f"{closest(self.scale, SCALES)}")
            if self.ref_len is not None and (not isinstance(self.ref_len, int) or self.ref_len < 2):
                raise RetrofitError(f"ssmax ref_len must be an integer >= 2, got {self.ref_len!r}")
            if self.s_init is not None and self.scale != "learned":
                raise RetrofitError(f"ssmax s_init applies to scale=learned only (scale={self.scale} has no s)")
            if self.beta is not None and self.scale != "llama4":
                raise RetrofitError(f"ssmax beta applies to scale=llama4 only, not scale={self.scale}")
            self.s_init = _float(self.s_init, "s_init")
            self.beta = _float(self.beta, "beta")
            self.blend = _blend(self.blend)
            if not isinstance(self.stack, bool):
                raise RetrofitError(f"ssmax stack must be true or false, got {self.stack!r}")

    def __init__(self, options, shape):
        super().__init__(options, shape)
        self.ref_len = options.ref_len or shape.max_positions or 2048  # L
        if options.scale == "learned":
            s_init = options.s_init if options.s_init is not None else 1.0 / math.log(self.ref_len)
            self.s = nn.Parameter(torch.full((shape.num_heads,), s_init))  # (H,)
        self.blend = options.blend  # the scheduled knob

    @classmethod
    def stacks_query_scaling(cls, options) -> bool:
        return options.stack

    @classmethod
    def owns_temperature(cls, options) -> bool:
        return True  # f(n) is the temperature: YaRN's own sqrt(attention_factor) on q and k would stack on it

    def logit_factor(self, n: torch.Tensor) -> torch.Tensor:
        """(B, H, R, 1) visible keys -> the factor (B, H, R, 1) this norm's logits are multiplied by."""
        return self.blended(self.factor(n[..., 0])).unsqueeze(-1)

    def set_scheduled_value(self, value: float) -> None:
        self.blend = _blend(value)

    def scheduled_value(self) -> float:
        return self.blend

    def forward(self, module, query, key, value, attention_mask, *, base, **kwargs):
        if self.options.scale == "learned":
            sink = model_sink(kwargs)
            if sink is None and self.blend == 1.0:
                return kernel_call(ssmax_attention, module, query, key, value, attention_mask, self.s, **kwargs)
            if sink is not None:  # scale q as ssmax_attention would, then softmax+1's kernel with the model's sink
                scaled = query.float() * self.blended(self.factor(self.visible(module, query, key, value,
                                                                                attention_mask, kwargs))).unsqueeze(-1)
                scaled = scaled.to(query.dtype)  # rounded once; an fp32 q would make the kernel copy k, v to fp32
                return kernel_call(softmax1_attention, module, scaled, key, value, attention_mask, sink, **kwargs)
        n = self.visible(module, query, key, value, attention_mask, kwargs)
        factor = self.blended(self.factor(n)).unsqueeze(-1)  # (..., Tq, 1): exactly 1.0 for n <= L (beyond, llama4)
        return base(module, (query * factor).to(query.dtype), key, value, attention_mask, **kwargs)

    @staticmethod
    def visible(module, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """Visible keys per query, counted exactly as the kernels do (padding excluded, cached keys included):
        broadcastable to (B, H, Tq)."""
        seen, _, mask, causal = visible_keys(module, query, key, value, attention_mask, kwargs.get("is_causal"))
        return visible_counts(mask, causal, query.shape[2], seen.shape[2], query.device)

    def blended(self, factor: torch.Tensor) -> torch.Tensor:
        """1 + alpha * (f - 1); alpha = 1 returns f itself (bitwise SSMax), alpha = 0 exactly 1.0."""
        return factor if self.blend == 1.0 else 1.0 + self.blend * (factor - 1.0)

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        """The logit multiplier for n visible keys (float32)."""
        if self.options.scale == "learned":  # (H,) x n -> (..., H, Tq)
            return self.s.float().view(-1, 1) * torch.log(n)
        if self.options.scale == "beyond":
            return (torch.log(n) / math.log(self.ref_len)).clamp_min(1.0)
        beta = 0.1 if self.options.beta is None else self.options.beta
        return 1.0 + beta * torch.log1p(torch.floor((n - 1.0) / self.ref_len))


def _float(value, name: str):
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RetrofitError(f"ssmax {name} must be a number, got {value!r}") from None


def _blend(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RetrofitError(f"ssmax blend must be a number >= 0, got {value!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise RetrofitError(f"ssmax blend must be a finite number >= 0 (0 = the original model, 1 = SSMax), "
                            f"got {value!r}")
    return value
