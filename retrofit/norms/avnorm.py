"""avnorm — normalize each head's attention output per token, before the output projection.

    o_h = A_h V_h                        # (B, T, D) for head h, from the model's own kernel
    rms:    y_h = g_h * o_h / sqrt(mean_d o_h^2 + eps)
    layer:  y_h = g_h * (o_h - mean_d o_h) / sqrt(var_d o_h + eps)
            = the AVnorm post's GroupNorm(num_groups=H, num_channels=H*D, affine=False) on (B*T, H*D)
    global: y   = g_h * LayerNorm over all H*D channels (the post's ablation: heads share one scale)

Per token and per head, never across time: normalizing across time would leak future tokens into
the past. `g_h` is a per-head gain (1-D, H values): 1 for a model trained with AVNorm from scratch,
or calibrated (`retrofit.calibrate`) to each head's mean output RMS so that a pretrained model, whose
output projection expects each head's own scale, starts close to its original function.
`affine=True` adds a per-channel weight (and, for layer/global, a bias) of H*D values.

floor (kind=rms): a per-head floor eps_h = f * g_h under each token's RMS,

    y_h = o_h * sqrt(g_h^2 + eps_h^2) / sqrt(mean_d o_h^2 + eps + eps_h^2)

f = 0 is plain AVNorm (the same code path, bitwise); f -> inf is the original model (f = inf exactly).
Measured on SmolLM2-135M (no training, vs. the unpatched model): f=4 +0.04 nats, 2 +0.19, 1 +0.47, 0 +0.87.
`recovery.schedule` anneals f from a large value to 0 while training (retrofit.recovery).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError
from . import register_norm
from .base import Norm, option

KINDS = ("rms", "layer", "global")


@register_norm
class AVNorm(Norm):
    name = "avnorm"
    summary = "per-head RMS/LayerNorm of each head's attention output (retrofittable)"
    formula = "y_h = g_h * norm_d(A_h V_h), norm = rms | layer (per head) | global (all heads)"
    acts_on_output = True  # a pre-hook on the output projection: any attention implementation (retrofit.patch)
    per_head = True  # heads= selects heads; the others pass through unchanged (Norm.keep_unselected)
    knob, knob_identity = "floor", 8.0  # f = 8: within ~0.01 nats of the original on SmolLM2 (f = inf is exact)

    @dataclass
    class Options:
        kind: str = option("rms", "rms | layer | global")
        affine: bool = option(False, "add a learned per-channel weight (and bias for layer/global)")
        eps: float = option(1e-5, "added to the variance before the square root")
        gain: float = option(1.0, "initial per-head gain; retrofit.calibrate() overwrites it")
        floor: float = option(0.0, "kind=rms: per-head floor eps = floor * gain under the RMS; 0 = AVNorm, large (inf) "
                                   "= the original model; recovery.schedule anneals it to 0")

        def __post_init__(self):
            if self.kind not in KINDS:
                raise RetrofitError(f"avnorm kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
            if not float(self.eps) > 0:
                raise RetrofitError(f"avnorm eps must be > 0, got {self.eps!r}")
            if isinstance(self.affine, str) or not isinstance(self.affine, (bool, int)):
                raise RetrofitError(f"avnorm affine must be true or false, got {self.affine!r}")
            self.eps, self.gain, self.affine = float(self.eps), float(self.gain), bool(self.affine)
            self.floor = _floor(self.floor, self.kind)

    def __init__(self, options, shape):
        super().__init__(options, shape)
        heads, dim = shape.num_heads, shape.head_dim
        self.gain = nn.Parameter(torch.full((heads,), options.gain))  # (H,)
        if options.affine:
            self.weight = nn.Parameter(torch.ones(heads * dim))
            bias = nn.Parameter(torch.zeros(heads * dim)) if options.kind != "rms" else None
            self.register_parameter("bias", bias)
        self.calibration = None  # a list while retrofit.calibrate() collects statistics
        self.floor = options.floor  # the scheduled knob (a float: a schedule moves it between steps)

    def set_knob(self, value: float) -> None:
        self.floor = _floor(value, self.options.kind)

    def knob_value(self) -> float:
        return self.floor

    def normalize(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) -> (B, T, H, D) normalized per the kind, before gain and affine. fp32 inside."""
        x = out.float()
        if self.options.kind == "global":
            x = x.flatten(-2)  # (B, T, H*D)
        if self.options.kind != "rms":
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.options.eps)
        return x.view_as(out)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) heads' outputs -> normalized, same shape and dtype. Observe-only while calibrating."""
        if self.calibration is not None:  # observe only: per-token RMS before and after, (B, T, H) each
            y = self.normalize(out)
            self.calibration.append((out.float().pow(2).mean(-1).sqrt(), y.pow(2).mean(-1).sqrt()))
            return out
        if self.floor:  # the floored form (recovery schedules); floor 0 is plain AVNorm
            y = self.floored(out)
        else:
            y = self.normalize(out) * self.gain.float().view(-1, 1)
        if self.options.affine:
            y = y * self.weight.float().view(y.shape[-2:])
            if self.bias is not None:
                y = y + self.bias.float().view(y.shape[-2:])
        return y.to(out.dtype)

    def floored(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) -> o * sqrt(g^2 + eps_h^2) / sqrt(ms(o) + eps + eps_h^2), eps_h = floor * g; fp32."""
        x = out.float()
        if self.floor == float("inf"):
            return x
        g2 = self.gain.float().pow(2).view(-1, 1)  # (H, 1)
        e2 = g2 * self.floor ** 2
        return x * torch.sqrt(g2 + e2) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.options.eps + e2)


def _floor(value, kind: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RetrofitError(f"avnorm floor must be a number >= 0, got {value!r}") from None
    if not value >= 0:
        raise RetrofitError(f"avnorm floor must be >= 0 (0 = AVNorm, inf = the original model), got {value!r}")
    if value and kind != "rms":
        raise RetrofitError(f"avnorm floor applies to kind=rms only (kind={kind} centers the output, so no floor "
                            "reaches the original model)")
    return value
