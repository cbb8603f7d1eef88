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

mode=beyond (kind=rms, no floor, no affine): the original model inside the trained length, a per-head correction of
the output's scale beyond it. n = the keys a query may see (position + 1, padding excluded, cached keys counted,
exactly as SSMax counts them); L = `ref_len`, default the model's ORIGINAL positions (before a `rope=` extension):

    y_h(n) = o_h(n) * (max(n, L) / L) ^ b_h          (exactly 1.0, so o_h untouched, for every n <= L)

A head's output RMS falls with the number of keys it averages over (r_h(n) ~ a_h * n^(-b_h)); beyond L the factor
holds it at its trained-length level r_h(L). b_h (H values, `exponent`) is a parameter: `retrofit.calibrate` fits it
per head on text inside L (least squares of log mean RMS on log n; clamped to [-1, 1]) and a finetune trains it.
It acts inside the attention function (it needs n), wrapping the base kernel as SSMax does; while no key lies
beyond L the base kernel's output is returned as it is (the same tensor).

Calibrating mode=beyond (Norm.fit_calibration here): from the mean output RMS per number of visible keys n on text
inside L, b_h is minus the least-squares slope of log r_h(n) on log n over n in [max(2, N // 16), N] (N = min(longest
text, L)), so that (n / L)^b_h holds r_h at r_h(L) beyond L. Rows of L tokens (calibration_rows), not 512: a fit over
n in [32, 512] would be extrapolated 64x to 32K; rows of L fit it where it is used, just inside L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RetrofitError, closest
from ..kernels.masks import visible_counts
from . import register_norm
from .attention_call import visible_keys
from .base import Norm, finite_number, option

KINDS = ("rms", "layer", "global")
MODES = ("always", "beyond")
# AVNorm with unit gains on a pretrained model, measured (docs/patching.md "Calibration"; SmolLM2-135M, 512 tokens)
UNCALIBRATED_COST = ("on SmolLM2-135M unit gains took the loss on a paragraph from 3.91 to 14.29 (calibrated on 8192 "
                     "tokens: 4.58)")
EXPONENT_RANGE = (-1.0, 1.0)  # calibrate() clamps the fitted b_h here: a fit on short text must not explode beyond L


@register_norm
class AVNorm(Norm):
    name = "avnorm"
    summary = "per-head RMS/LayerNorm of each head's attention output (retrofittable)"
    formula = "y_h = g_h * norm_d(A_h V_h), norm = rms | layer (per head) | global (all heads)"
    acts_on_output = True  # a pre-hook on the output projection: any attention implementation (retrofit.patch)
    per_head = True  # heads= selects heads; the others pass through unchanged (Norm.keep_unselected)
    example_variants = ({"kind": "layer"}, {"kind": "global"})
    # f = 8: within ~0.01 nats of the original on SmolLM2 (f = inf is exact)
    scheduled_option, schedule_identity = "floor", 8.0
    card = ("softmax weights sum to 1, so a head that averages more values as the context grows outputs a smaller and "
            "smaller vector (its variance falls roughly as 1/L: variance collapse), and the layers after it see a "
            "scale they were never trained on. AVNorm normalizes each head's output per token, so its scale no "
            "longer depends on the context length.")
    diagnosis = ("weights are softmax, so 1, 3, 4, 5 are the paper's; 2 measures the head output after the per-head "
                 "norm (`out`) as well as the softmax average before it (`AV`).")
    calibrated_by_default = True  # unit gains ruin a pretrained model (UNCALIBRATED_COST)
    calibration_hint = "avnorm"
    serve_as = "outputs"  # vLLM: each head's output through this module before o_proj (mode=beyond: times factor(n))

    @dataclass
    class Options:
        kind: str = option("rms", "rms | layer | global", example="layer",
                           elsewhere="the output gate's kind (gate.py); what a loaded source is (load/info.py, hub/)")
        affine: bool = option(False, "add a learned per-channel weight (and bias for layer/global)")
        eps: float = option(1e-5, "added to the variance before the square root", example=1e-3,
                            elsewhere="diagnose's eps measure (diagnose/measures.py, summary.py)")
        gain: float = option(1.0, "initial per-head gain; retrofit.calibrate() overwrites it", example=0.5)
        floor: float = option(0.0, "kind=rms: per-head floor eps = floor * gain under the RMS; 0 = AVNorm, large (inf) "
                                   "= the original model; recovery.schedule anneals it to 0", example=0.25)
        mode: str = option("always", "always (normalize every token) | beyond (the original model inside L; beyond "
                                     "it each head's output times (n / L)^b_h, b_h calibrated and trainable)",
                           example="beyond")
        exponent: float = option(0.0, "mode=beyond: initial b_h (0 = the original model everywhere); "
                                      "retrofit.calibrate() fits it per head",
                                example={"mode": "beyond", "exponent": 0.25})
        ref_len: int | None = option(None, "mode=beyond: L; default the model's original max positions (before rope=)",
                                     example={"mode": "beyond", "ref_len": 16})

        def __post_init__(self):
            if self.kind not in KINDS:
                raise RetrofitError(f"avnorm kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
            if self.mode not in MODES:
                raise RetrofitError(f"avnorm mode must be one of {', '.join(MODES)}, got {self.mode!r}"
                                    f"{closest(str(self.mode), MODES)}")
            if not float(self.eps) > 0:
                raise RetrofitError(f"avnorm eps must be > 0, got {self.eps!r}")
            if isinstance(self.affine, str) or not isinstance(self.affine, (bool, int)):
                raise RetrofitError(f"avnorm affine must be true or false, got {self.affine!r}")
            self.eps, self.gain, self.affine = float(self.eps), float(self.gain), bool(self.affine)
            self.floor = _floor(self.floor, self.kind)
            self.exponent = _number(self.exponent, "exponent")
            if self.mode == "beyond":
                _check_beyond(self)
            elif self.ref_len is not None or self.exponent != 0.0:
                raise RetrofitError("avnorm exponent and ref_len apply to mode=beyond only (add mode=beyond)")

    @classmethod
    def on_output(cls, options) -> bool:
        return options.mode != "beyond"  # beyond needs n per query: it acts inside the attention function

    @classmethod
    def calibrates(cls, options) -> bool:
        return True

    def calibrated_parameter(self) -> str:
        return "exponent" if self.options.mode == "beyond" else "gain"

    @classmethod
    def calibration_given(cls, given: dict) -> bool:
        return given.get("gain") is not None

    def calibration_rows(self, rows: int) -> int:
        return max(rows, self.ref_len) if self.options.mode == "beyond" else rows

    def calibration_sums(self, device) -> list[torch.Tensor]:
        """mode=beyond: sums of RMS and token counts per (n, head), (L + 1, H) each; otherwise RMS before and after."""
        if self.options.mode != "beyond":
            return super().calibration_sums(device)
        return [torch.zeros(self.ref_len + 1, self.shape.num_heads, dtype=torch.float64, device=device)
                for _ in range(2)]

    def add_calibration(self, sums: list[torch.Tensor], recorded: tuple, valid: torch.Tensor) -> None:
        if self.options.mode == "beyond":  # recorded: (visible keys, per-token RMS), see beyond()
            add_by_length(*sums, *recorded, valid)
        else:
            super().add_calibration(sums, recorded, valid)

    def fit_calibration(self, sums: list[torch.Tensor]) -> torch.Tensor:
        return fit_exponents(*sums) if self.options.mode == "beyond" else super().fit_calibration(sums)

    @classmethod
    def uncalibrated_cost(cls, given: dict) -> str | None:
        if given.get("gain") is None and given.get("mode", "always") == "always":
            return f"AVNorm without calibration starts every head at gain 1, which ruins a pretrained model until " \
                   f"trained: {UNCALIBRATED_COST}"
        return None

    @classmethod
    def report_options(cls, options: dict) -> tuple[list[str], str]:
        beyond = options.get("mode") == "beyond"  # ref_len means something with mode=beyond only
        return ["gain", "exponent"] + ([] if beyond else ["ref_len"]), "exponent" if beyond else "gain"

    def __init__(self, options, shape):
        super().__init__(options, shape)
        heads, dim = shape.num_heads, shape.head_dim
        self.calibration = None  # a list while retrofit.calibrate() collects statistics
        if options.mode == "beyond":
            self.acts_on_output = False
            self.ref_len = options.ref_len or shape.max_positions or 2048  # L
            self.exponent = nn.Parameter(torch.full((heads,), options.exponent))  # (H,) b_h
            self.floor = 0.0
            return
        self.gain = nn.Parameter(torch.full((heads,), options.gain))  # (H,)
        if options.affine:
            self.weight = nn.Parameter(torch.ones(heads * dim))
            bias = nn.Parameter(torch.zeros(heads * dim)) if options.kind != "rms" else None
            self.register_parameter("bias", bias)
        self.floor = options.floor  # the scheduled knob (a float: a schedule moves it between steps)

    def set_scheduled_value(self, value: float) -> None:
        if self.options.mode == "beyond":
            raise RetrofitError("avnorm mode=beyond has no floor to schedule (it is the original model inside L "
                                "already): drop recovery.schedule")
        self.floor = _floor(value, self.options.kind)

    def scheduled_value(self) -> float:
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

    def forward(self, out: torch.Tensor, *attention, base=None, **kwargs) -> torch.Tensor:
        """(B, T, H, D) heads' outputs -> normalized, same shape and dtype. Observe-only while calibrating.
        mode=beyond is called as an attention function instead: (module, q, k, v, mask, base=..., **kwargs)."""
        if base is not None:
            return self.beyond(out, *attention, base=base, **kwargs)
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


    def beyond(self, module, query, key, value, attention_mask, *, base, **kwargs):
        """mode=beyond: the base kernel's (out (B, Tq, H, D), weights), out times factor(n) per head and query."""
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        if self.calibration is None and key.shape[2] <= self.ref_len:
            return out, weights  # no query sees more than L keys: the base output itself, untouched
        seen, _, mask, causal = visible_keys(module, query, key, value, attention_mask, kwargs.get("is_causal"))
        n = visible_counts(mask, causal, query.shape[2], seen.shape[2], query.device)  # broadcastable (B, H, Tq)
        if self.calibration is not None:  # observe only: (visible keys, per-token RMS (B, Tq, H))
            self.calibration.append((n, out.float().pow(2).mean(-1).sqrt()))
            return out, weights
        factor = self.factor(n).expand(out.shape[0], -1, -1)  # (B, H, Tq)
        return (out * factor.transpose(1, 2).unsqueeze(-1)).to(out.dtype), weights

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        """(max(n, L) / L)^b_h for n visible keys (broadcastable to (B, H, Tq)): float32 (B or 1, H, Tq), exactly
        1.0 wherever n <= L."""
        while n.dim() < 3:
            n = n.unsqueeze(0)
        ratio = n.float() / self.ref_len  # (B or 1, H or 1, Tq)
        scaled = torch.exp(self.exponent.float().view(-1, 1) * torch.log(ratio.clamp_min(1.0)))  # (., H, Tq)
        return torch.where(ratio > 1.0, scaled, torch.ones_like(scaled))


def add_by_length(sums: torch.Tensor, counts: torch.Tensor, n: torch.Tensor, rms: torch.Tensor,
                  valid: torch.Tensor) -> None:
    """Accumulate per (n, head) the sum of RMS and the token count, n <= L only (sums: (L + 1, H)).
    n: visible keys broadcastable to (B, H, T); rms (B, T, H); valid (B, T, 1)."""
    while n.dim() < 3:
        n = n.unsqueeze(0)
    n = n.expand(rms.shape[0], rms.shape[2], rms.shape[1]).transpose(1, 2).long()  # (B, T, H)
    keep = valid.expand_as(rms) & (n < sums.shape[0])
    index = (n * sums.shape[1] + torch.arange(sums.shape[1], device=n.device))[keep]  # flat (n, h)
    sums.view(-1).index_add_(0, index, rms[keep].double())
    counts.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))


def fit_exponents(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(L + 1, H) RMS sums and counts per n -> (H,) b_h: minus the slope of log mean RMS on log n (see above)."""
    seen = (counts[:, 0] > 0).nonzero().flatten()
    top = int(seen.max()) if len(seen) else 0
    n = torch.arange(max(2, top // 16), top + 1, device=sums.device)
    n = n[counts[n, 0] > 0]
    if len(n) < 2:
        raise RetrofitError("calibrating avnorm mode=beyond needs texts of at least 3 tokens (it fits each head's "
                            "output RMS against length)")
    x = torch.log(n.double())[:, None]  # (N, 1)
    y = torch.log((sums[n] / counts[n]).clamp_min(1e-30))  # (N, H)
    xc, yc = x - x.mean(0), y - y.mean(0)
    slope = (xc * yc).sum(0) / (xc * xc).sum(0)
    return (-slope).clamp(*EXPONENT_RANGE)


def _number(value, name: str) -> float:
    return finite_number(value, f"avnorm {name}")


def _check_beyond(opts) -> None:
    """mode=beyond leaves every token's normalization off: what only the normalizing modes mean is refused."""
    if opts.kind != "rms":
        raise RetrofitError(f"avnorm mode=beyond rescales each head's output by length and has no kind={opts.kind} "
                            "(drop kind, or use mode=always)")
    if opts.floor or opts.affine or opts.gain != 1.0:
        raise RetrofitError("avnorm mode=beyond takes no floor, affine or gain (it is the original model inside L; "
                            "its per-head exponent is calibrated): drop them, or use mode=always")
    if opts.ref_len is not None and (isinstance(opts.ref_len, bool) or not isinstance(opts.ref_len, int)
                                     or opts.ref_len < 2):
        raise RetrofitError(f"avnorm ref_len must be an integer >= 2, got {opts.ref_len!r}")


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
