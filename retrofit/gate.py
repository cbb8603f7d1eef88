"""Output gating as a patch option: each head's attention output times a sigmoid gate computed from the layer input.

    retrofit.patch(model, "avnorm", kind="layer", gate="head")        # a retrofit: the original model at step 0
    retrofit.patch(model, "softmax", gate="head:0.5:12")             # the AVnorm post's gate (from scratch)
    retrofit.patch(model, "ssmax", gate={"kind": "element"})         # Gated Attention's elementwise form

For each token, with x the attention module's input (B, T, C) and o_h the head's output after the norm:

    y_h = o_h * 2s * sigmoid(W_h x[:I] + b_h)      kind=head:    one gate per head, W (H, I), b (H,)
    y_hd = o_hd * 2s * sigmoid(W_hd x[:I] + b_hd)  kind=element: one per output channel, W (H*D, I), b (H*D,)

then the output projection, as Gated Attention (Qiu et al. 2025; Qwen3-Next) and the AVnorm post's model
(`y * sigmoid(W x[..., :12])`, after its per-head GroupNorm) place it. W and b start at zero, so the gate starts at
`s` (`start`) for every token. String grammar (`normalize_gate`): ``KIND[:START[:INPUTS]]``: ``head``, ``element``,
``head:0.5`` (the post's start), ``head:0.5:12`` (the post's gate: the first 12 input channels); a mapping
{kind, start, inputs} says the same.

Why 2s * sigmoid and not sigmoid with a large bias: the gate must start as the exact identity for a retrofit (the
patched model's logits equal the ungated patch's, bitwise). sigmoid(0) is exactly 0.5 in every float format, so
start 1 gives 2 * 0.5 = 1.0 exactly and o * 1.0 is o, bit for bit; and the gate's slope there is 0.5, so it trains
from the first step. sigmoid(b) rounds to 1.0 in fp32 only for b > ~17, where its slope is below 1e-7: an identity
that cannot learn. With start 0.5 the formula is the post's sigmoid itself (2 * 0.5 = 1), and 0.5 at step 0.

How the gate sees x: transformers' attention function is handed q, k, v and the attention module, never the
module's input. `pass_gate_input`, a forward pre-hook (with kwargs) on each gated attention module, adds the input
hidden states to the keyword arguments of that call, which every family in retrofit's table forwards to its
attention function; retrofit's function takes them out before calling the kernel (retrofit.patch `_dispatch`). The
value travels with the call, so threads sharing one model never see each other's, and Dynamo traces it as an
ordinary argument. A gated patch therefore always runs retrofit's attention function (over sdpa or eager), and the
norm of an output-side norm (AVNorm) is applied there too, before the gate, instead of at the output projection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .errors import RetrofitError, closest, quoted

KINDS = ("head", "element")
GATE_INPUT = "retrofit_gate_input"  # the keyword that carries the attention module's input to the attention function
KEYS = ("kind", "start", "inputs")
# START's range: the gate computes 2 * start * sigmoid(z) in float32 and casts it to the model's dtype, so 2 * start
# must stay finite there, and far from overflow once it multiplies an attention output (fp16's largest is 65,504;
# start 1e39 gave inf, then every logit NaN: issue 61). 1 is the identity, 0.5 the AVnorm post's; nothing needs more.
START_RANGE = (1e-6, 1e3)


def normalize_gate(value, what: str = "gate") -> dict | None:
    """'head' | 'head:0.5' | 'head:0.5:12' | {kind, start, inputs} | None -> {"kind", "start", "inputs"} or None,
    checked (one-line errors naming `what`)."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(":")]
        if len(parts) > 3 or not parts[0]:
            raise RetrofitError(f"{what} {quoted(value, 40)}: write KIND[:START[:INPUTS]], e.g. head, head:0.5:12")
        value = dict(zip(KEYS, parts))
    if not isinstance(value, Mapping):
        raise RetrofitError(f"{what} must be head, element, KIND:START[:INPUTS] or a mapping {{kind, start, inputs}}, "
                            f"got {quoted(value)}")
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise RetrofitError(f"{what} has no key {quoted(unknown[0])}{closest(str(unknown[0]), KEYS)}; its keys: "
                            f"{', '.join(KEYS)}")
    kind = value.get("kind")
    if kind not in KINDS:
        raise RetrofitError(f"{what} kind must be one of {', '.join(KINDS)}, got {quoted(kind)}"
                            f"{closest(str(kind), KINDS)}")
    return {"kind": kind, "start": _start(value.get("start", 1.0), what),
            "inputs": _inputs(value.get("inputs"), what)}


def _start(value, what: str) -> float:
    try:
        start = float(value)
    except (TypeError, ValueError):
        start = math.nan
    low, high = START_RANGE
    if isinstance(value, bool) or not (math.isfinite(start) and start > 0):
        raise RetrofitError(f"{what} start must be a number > 0 (the gate's value at step 0: 1 = the identity, for a "
                            f"retrofit; 0.5 = the AVnorm post's), got {quoted(value)}")
    if not low <= start <= high:
        raise RetrofitError(f"{what} start {start:g} is outside {low:g}..{high:g} (the gate's value at step 0, times "
                            f"2 in float32 and in the model's dtype: 1 = the identity, 0.5 = the AVnorm post's); give "
                            f"a start in that range")
    return start


def _inputs(value, what: str) -> int | None:
    if value is None or value in ("all", "null", "none"):
        return None
    try:
        inputs = int(value)
    except (TypeError, ValueError):
        inputs = 0
    if isinstance(value, bool) or str(inputs) != str(value).strip() or inputs < 1:  # the model's width bounds it
        raise RetrofitError(f"{what} inputs must be a whole number of input channels >= 1 (the post's gate reads "
                            f"12), or all, got {quoted(value)}")
    return inputs


def describe_gate(gate: dict | None) -> str:
    """{'kind': 'head', 'start': 0.5, 'inputs': 12} -> 'head, 0.5 at start, from input channels 0-11'."""
    if not gate:
        return "none"
    source = "the layer input" if gate["inputs"] is None else f"input channels 0-{gate['inputs'] - 1}"
    return f"{gate['kind']}, {gate['start']:g} at start ({'identity' if gate['start'] == 1 else 'not identity'}), " \
           f"from {source}"


class OutputGate(nn.Module):
    """The gate of one attention module: `weight` (G, I) and `bias` (G,), G = heads (kind=head) or heads * head_dim
    (kind=element), both zero at start; lives in the norm module (`<attention>.retrofit.gate`), so it is saved,
    reloaded, trained under PEFT's modules_to_save and removed by unpatch with the norm."""

    def __init__(self, gate: dict, heads: int, head_dim: int, hidden_size: int):
        super().__init__()
        inputs = gate["inputs"] or hidden_size
        if inputs > hidden_size:
            raise RetrofitError(f"gate inputs {inputs} exceeds the attention input's {hidden_size} channels; give "
                                f"at most {hidden_size}, or all")
        self.kind, self.start, self.inputs, self.heads = gate["kind"], gate["start"], inputs, heads
        outputs = heads if gate["kind"] == "head" else heads * head_dim
        self.weight = nn.Parameter(torch.zeros(outputs, inputs))  # (G, I)
        self.bias = nn.Parameter(torch.zeros(outputs))  # (G,)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) layer input -> (B, T, H, 1 or D) gate values, float32: 2s * sigmoid(W x[:I] + b)."""
        z = F.linear(x[..., :self.inputs].float(), self.weight.float(), self.bias.float())  # (B, T, G)
        return (2.0 * self.start * torch.sigmoid(z)).view(*z.shape[:-1], self.heads, -1)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) heads' outputs, (B, T, C) the attention module's input -> gated outputs, out's dtype."""
        return out * self.values(x).to(out.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, start={self.start:g}, inputs={self.inputs}, heads={self.heads}"


def pass_gate_input(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (with_kwargs=True) on a gated attention module: its input hidden states ride to the attention
    function as the GATE_INPUT keyword (GPT-2 passes them positionally, the Llama family by name)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return args, {**kwargs, GATE_INPUT: hidden}


def drop_gate_hook(module: nn.Module) -> None:
    """Remove pass_gate_input from `module` (retrofit.unpatch)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is pass_gate_input:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def gated(norm: nn.Module, out: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
    """`out` (B, T, H, D) through the norm module's gate, if it has one (`norm` may be PEFT's modules_to_save wrapper:
    its attribute is the active copy's); refused in one line when the gate's input did not arrive or does not match."""
    gate = getattr(norm, "gate", None)
    if gate is None:
        return out
    if x is None:
        raise RetrofitError("this attention module is gated but its call carried no input for the gate (its model's "
                            "attention does not forward its keyword arguments to the attention function); unpatch it "
                            "and patch without gate")
    if x.shape[:-1] != out.shape[:2]:
        raise RetrofitError(f"the gate's input has {tuple(x.shape[:-1])} tokens but the attention output "
                            f"{tuple(out.shape[:2])} (sequence parallelism shards one and not the other); run the gate "
                            "on one process per row")
    return gate(out, x)


__all__ = ["GATE_INPUT", "KINDS", "OutputGate", "describe_gate", "drop_gate_hook", "gated", "normalize_gate",
           "pass_gate_input"]
