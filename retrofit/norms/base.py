"""What every norm shares: the attention shape it is built for, the Norm class and its hooks, option().
How a norm calls the kernels (visible keys, masks, sinks, position bias) is attention_call.py; how a norm of the
heads' outputs (acts_on_output) hooks the output projection is output_hook.py; a norm that defines only its
weights starts from weights_only.py.

A norm is an `nn.Module` attached to one attention module as its `retrofit` child. Its parameters
(1-D tensors, never 0-d, so FSDP can shard them) are part of the model's state_dict, and PEFT's
`modules_to_save` can target them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..errors import RetrofitError
from .options import OptionSpec, option_schema

CHILD = "retrofit"  # name of the norm module attached to each attention module


def option(default, doc: str, *, example=None, elsewhere: str = ""):
    """A dataclass field with a docstring that `retrofit norms` prints (options.py reads it as an OptionSpec).
    `example`: a valid value other than the default, or the options that show one ({"scale": "llama4", "beta": 0.2}
    where the option applies only beside another); a switch's is its opposite. The tests save and reload each.
    `elsewhere`: what else in retrofit this word names (the gate's kind, the kernels' p), so that the name test counts
    only reads of it from a norm's options."""
    return dataclasses.field(default=default, metadata={"doc": doc, "example": example, "elsewhere": elsewhere})


@dataclass(frozen=True)
class AttentionShape:
    """The facts about one attention module a norm needs to build its parameters."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int | None  # the model's max_position_embeddings, if it has one


class Norm(nn.Module):
    """Base of all norms. Subclasses set `name`, `summary`, `formula`, `Options` and implement forward."""

    name: ClassVar[str]
    summary: ClassVar[str]
    formula: ClassVar[str]
    Options: ClassVar[type]
    scales_queries_by_position: ClassVar[bool] = False  # True: refused on models that already do (families.py)
    # True: the norm acts on each head's output, i.e. on the attention output projection's input (B, T, H*D),
    # as a forward pre-hook there: it then works over any attention implementation (flash, flex, Hub kernels,
    # paged) and survives set_attn_implementation. False: it changes the weights, inside the attention function.
    acts_on_output: ClassVar[bool] = False
    # Identity-start schedules (retrofit.recovery): the option a schedule moves, and the value of that option at
    # which the norm is (or is within 1e-6 of) the original model. None: this norm has no such knob.
    scheduled_option: ClassVar[str | None] = None
    schedule_identity: ClassVar[float | None] = None
    # True: the norm acts per head (per-head parameters or a per-head value), so `retrofit.patch(..., heads=)` can
    # select heads; the unselected heads keep the original attention (see select_heads).
    per_head: ClassVar[bool] = False
    # What the rest of retrofit says about this norm comes from here, never from a branch on its name elsewhere
    # (docs/adding-a-norm.md): the model card, diagnose's report, calibration, the reports and the benchmarks.
    baseline: ClassVar[bool] = False  # True: the model's own attention (softmax): the control arm, the unpatched label
    card: ClassVar[str] = ""  # the model card's "Why:" (what this norm changes and why it helps); "" = the summary
    diagnosis: ClassVar[str] = ""  # how diagnose's five measures read under this norm (its report says it)
    example_options: ClassVar[dict] = {}  # the options benchmarks and the norm contract test patch with (p=2 ...)
    # Other formulas the same file computes, each as the options that select it (avnorm kind=layer): every family is
    # patched with each, beside example_options, against the float64 reference (tests/patch/test_patch.py).
    example_variants: ClassVar[tuple[dict, ...]] = ()
    decode_target: ClassVar[float | None] = None  # `retrofit bench decode`: time per token vs unpatched; None: 1.05
    # True: a fresh patch on a pretrained model is calibrated unless told not to (patch.calibrate_tokens, diagnose):
    # its starting point would ruin the model (AVNorm's unit gains). False: calibration only when asked (gain=1).
    calibrated_by_default: ClassVar[bool] = False
    calibration_hint: ClassVar[str | None] = None  # how to ask for a calibrated patch of it, in errors: "avnorm"
    # How vLLM's model code runs this norm (retrofit/serve/llama.py), one of retrofit.serve.plan.SERVE_STEPS: "plain"
    # (vLLM's attention as it is), "queries" (q times logit_factor(n) per head and position, n = position + 1),
    # "outputs" (each head's output through the norm before o_proj; acting inside attention: times factor(n) per
    # head), "sinks" (the norm's (H,) `sink` as vLLM's attention sinks). None: refused (serve_refusal says why).
    serve_as: ClassVar[str | None] = None

    def __init__(self, options: Any, shape: AttentionShape):
        super().__init__()
        self.options = options
        self.shape = shape
        self.register_buffer("head_mask", None, persistent=False)  # (H,) bool: the selected heads; None = all

    def select_heads(self, heads: list[int] | None) -> None:
        """Act on `heads` only (query-head indices); None = every head. Not in the state_dict: config.retrofit
        records the selection and the patch rebuilds it. The parameters keep their full (H,) shape."""
        if heads is None or len(heads) == self.shape.num_heads:
            self.head_mask = None
            return
        mask = torch.zeros(self.shape.num_heads, dtype=torch.bool)
        mask[list(heads)] = True
        self.head_mask = mask

    def keep_unselected(self, out: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) outputs: the norm's on the selected heads, `original` (bitwise) on the others."""
        if self.head_mask is None:
            return out
        return torch.where(self.head_mask.to(out.device).view(-1, 1), out.to(original.dtype), original)

    @property
    def has_parameters(self) -> bool:
        """Whether this norm, as built with its options, has parameters (p-softmax: only with a gain; SSMax: only
        learned): what an adapter or a push must carry besides the base model."""
        return any(True for _ in self.parameters())

    def forward(self, module: nn.Module, query, key, value, attention_mask, *, base: Callable, **kwargs):
        raise NotImplementedError

    @classmethod
    def option_schema(cls) -> tuple[OptionSpec, ...]:
        """Each option (name, type from its hint, default, doc), in declared order: what the CLI's flags, record
        validation and the recipe's patch section read (options.py)."""
        return option_schema(cls.Options, cls.name)

    def set_scheduled_value(self, value: float) -> None:
        """Move the scheduled knob (the option named by `scheduled_option`) to `value`; read on the next call."""
        raise NotImplementedError(f"{self.name} has no scheduled knob")

    def scheduled_value(self) -> float:
        """The knob's current value (what `config.retrofit` records after training)."""
        raise NotImplementedError(f"{self.name} has no scheduled knob")

    @classmethod
    def on_output(cls, options) -> bool:
        """Whether this norm, built with `options`, acts on the heads' outputs (acts_on_output) rather than inside
        the attention function: what retrofit.patch decides the implementation by (AVNorm mode=beyond: inside)."""
        return cls.acts_on_output

    @classmethod
    def sink_refusal(cls, options) -> str | None:
        """Why this norm cannot keep a model's own learned attention sinks (gpt_oss), or None if it keeps them.
        Norms that call the wrapped kernel (softmax, AVNorm) keep them: the model's eager function applies them."""
        return None

    @classmethod
    def sink_note(cls, options) -> str:
        """What happens to a model's own learned sinks under this norm, for the PatchReport's note."""
        return "kept"

    @classmethod
    def stacks_query_scaling(cls, options) -> bool:
        """Whether this norm, built with `options`, may scale queries by position on a model that already does
        (Llama 4; scales_queries_by_position), on top of the model's own; False: retrofit.patch refuses it."""
        return False

    @classmethod
    def owns_temperature(cls, options) -> bool:
        """Whether this norm, built with `options`, sets the logits' temperature itself (SSMax's s*log n): then a
        RoPE extension that also scales the logits (YaRN's and LongRoPE's attention factor, at every position) gets
        that factor 1, so one correction owns the temperature instead of two stacking (retrofit.rope
        compose_temperature). An attention_factor the user gives explicitly is kept."""
        return False

    @classmethod
    def serve_refusal(cls, options, heads: list[int] | None) -> str | None:
        """Why retrofit's vLLM plugin cannot serve this norm built with `options` on `heads` (None = all), in one line
        that says what to run instead; None: it serves it as `serve_as` says (or refuses it for having none)."""
        return None

    # ---- calibration (retrofit.calibrate) and how a report shows it -------------------------------------------------

    @classmethod
    def calibrates(cls, options) -> bool:
        """Whether this norm, built with `options`, has per-head values retrofit.calibrate sets."""
        return False

    def calibrated_parameter(self) -> str | None:
        """The name of the parameter retrofit.calibrate sets (fit_calibration's values), or None: p-softmax's "gain",
        AVNorm's "gain" or, with mode=beyond, "exponent"."""
        return None

    @classmethod
    def calibration_given(cls, given: dict) -> bool:
        """Whether the options given (those the user wrote) set what calibration would (AVNorm's `gain`), so a norm
        calibrated_by_default is not calibrated by default (a recipe's patch.calibrate_tokens: 0)."""
        return False

    def calibration_rows(self, rows: int) -> int:
        """Tokens per calibration row this norm's fit needs, `rows` being the default (a mean over tokens: as many)."""
        return rows

    def calibration_sums(self, device) -> list[torch.Tensor]:
        """Zeroed float64 sums of what the forward records in `self.calibration` (a list while calibrating): by
        default the RMS of the original and of the norm's head outputs, (H,) each."""
        return [torch.zeros(self.shape.num_heads, dtype=torch.float64, device=device) for _ in range(2)]

    def add_calibration(self, sums: list[torch.Tensor], recorded: tuple, valid: torch.Tensor) -> None:
        """Add one forward's entry (per-token RMS before, after: (B, T, H) each) over valid tokens (B, T, 1)."""
        for total, rms in zip(sums, recorded):
            total += (rms * valid).sum((0, 1)).double()

    def fit_calibration(self, sums: list[torch.Tensor]) -> torch.Tensor:
        """(H,) values retrofit.calibrate writes into calibrated_parameter(), from the sums: by default a gain, mean
        RMS of the original head output over mean RMS of the norm's."""
        before, after = sums
        return before / after.clamp_min(1e-12)

    @classmethod
    def uncalibrated_cost(cls, given: dict) -> str | None:
        """What patching a pretrained model with these options (those the user gave) and no calibration costs,
        measured, for `retrofit patch`'s warning; None: nothing to warn about."""
        return None

    @classmethod
    def report_options(cls, options: dict) -> tuple[list[str], str | None]:
        """(options a PatchReport leaves out, the one it shows with its calibration: "gain" calibrated on N tokens)."""
        return [], None

    # ---- diagnose: the weights this norm gives the logits l = q.k * scaling of some query rows -----------------------

    def logit_factor(self, n: torch.Tensor) -> torch.Tensor | None:
        """The factor this norm multiplies the logits by before its map, for n visible keys (B, H, R, 1); None: 1."""
        return None

    def bound_terms(self) -> tuple[float, torch.Tensor | None]:
        """(p, sink logit (H, 1) or None): what Corollary 1's bounds on a weight need of this norm."""
        return 1.0, None

    def weights(self, logits: torch.Tensor, n: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """(B, H, R, T) logits (-inf on hidden keys), n (B, H, R, 1) visible keys -> the weights this norm makes,
        every logit divided by `temperature` first (diagnose's g(T, eps)). Softmax here; AVNorm keeps it."""
        return softmax_rows(self.scaled(logits, n) / temperature)

    def scaled(self, logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The logits times logit_factor(n); hidden keys stay -inf (a factor 0, log 1 for one visible key, keeps them
        hidden, as scaling q in the forward does)."""
        factor = self.logit_factor(n)
        if factor is None:
            return logits
        return torch.where(torch.isneginf(logits), logits, logits * factor.to(logits.dtype))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.options).items())


def finite_number(value, what: str, hint: str = "") -> float:
    """float(value) for a norm option, else a one-line error naming it (`hint` says what a good value is)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RetrofitError(f"{what} must be a finite number, got {value!r}{hint}") from None
    if not math.isfinite(value):
        raise RetrofitError(f"{what} must be finite{hint}, got {value!r}")
    return value


def softmax_rows(logits: torch.Tensor, p: float = 1.0) -> torch.Tensor:
    """exp(l) / ||exp(l)||_p along the last dim (p = 1: softmax); -inf logits are hidden keys (weight 0)."""
    m = logits.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    e = torch.exp(logits - m)
    norm = e.sum(-1, keepdim=True) if p == 1.0 else e.pow(p).sum(-1, keepdim=True).pow(1.0 / p)
    return e / norm.clamp_min(1e-300)
