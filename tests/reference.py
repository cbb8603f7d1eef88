"""Independent reference attention, written from the formulas in the seeds (not from retrofit's code).

Registered with transformers under its own name with eager's (additive) mask, it materializes the
full weight matrix in float64 and applies each norm exactly as the posts define it. A reference model
is the unpatched twin switched to this function, with positions removed by hand for NoPE: GPT-2's
table zeroed, rotary frequencies zeroed (cos = 1, sin = 0).

A model's own learned sinks (gpt_oss's s_aux) join every row's denominator, combined with softmax+1's. An output gate
(retrofit.gate) multiplies each head's output, after AVNorm, by 2s * sigmoid(W x[:I] + b) from the attention
module's input x, which a forward pre-hook of the reference keeps on the module for the call (one thread only).
It applies Gemma 2's logit soft-cap (c * tanh(s / c), after SSMax's query scaling, before the mask)
and a layer's `sliding_window` explicitly from the kwargs the model passes, on top of the mask
(query at cache index i sees keys i - W < j <= i), so a kernel that ignored the window would differ.
`naive_attention` is the same math at kernel level, on (B, H, T, D) tensors.

A norm that defines only its weights (retrofit.norms.weights_only) brings its float64 formula in its own parity test,
tests/norms/test_<name>.py, as `reference_weights(s, allowed, n, options, params)`: the reference reads it from
there (own_formula), so adding such a norm edits no file here. The masks, n and the values stay this file's.
"""

from __future__ import annotations

import copy
import importlib
import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "retrofit_test_reference"


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    spec = module.reference_spec  # dict(norm=..., options=..., params=...), set by reference_model()
    b, h, tq, d = query.shape
    rep = h // key.shape[1]
    k = key.double().repeat_interleave(rep, 1)
    v = value.double().repeat_interleave(rep, 1)
    q = query.double()
    scaling = d ** -0.5 if scaling is None else scaling
    tk = k.shape[2]
    allowed = torch.ones(b, h, tq, tk, dtype=torch.bool)
    if kwargs.get("sliding_window"):
        allowed = allowed & window_mask(tq, tk, kwargs["sliding_window"])
    bias = torch.zeros(b, h, tq, k.shape[2], dtype=torch.float64)
    if attention_mask is None:
        if tq > 1:
            allowed = allowed & torch.ones(tq, k.shape[2], dtype=torch.bool).tril(k.shape[2] - tq)
    else:
        m = attention_mask[:, :, :, : k.shape[2]].double()
        allowed = allowed & (m > -1e30)
        bias = bias + torch.where(allowed, m, 0.0)
    name, opts, params = spec["norm"], spec["options"], spec["params"]
    if name == "ssmax":
        n = allowed.sum(-1, keepdim=True).clamp_min(1).double()  # keys visible to each query
        q = q * (params["s"].double().view(1, h, 1, 1) * torch.log(n))
    s = (q @ k.transpose(-1, -2)) * scaling
    if kwargs.get("softcap") is not None:
        s = kwargs["softcap"] * torch.tanh(s / kwargs["softcap"])
    s = (s + bias).masked_fill(~allowed, -math.inf)
    sink = params["sink"].double() if name == "softmax1" else None
    if kwargs.get("s_aux") is not None:  # the model's own learned sinks (gpt_oss): one more logit per row
        theirs = kwargs["s_aux"].double()
        sink = theirs if sink is None else torch.logaddexp(sink, theirs)
    formula = own_formula(name)
    if formula is not None:  # a weights-only norm: its test's float64 formula, hidden keys 0 as for every norm
        n = allowed.sum(-1, keepdim=True).clamp_min(1).double()
        w = torch.where(allowed, formula(s, allowed, n, opts, params), 0.0)
    elif name == "psoftmax" and sink is None:
        e = torch.exp(s - s.amax(-1, keepdim=True))
        w = e / (e ** opts["p"]).sum(-1, keepdim=True) ** (1.0 / opts["p"])
    elif sink is not None:  # softmax+1 (p-softmax only at p = 1 here): exp(b_h) joins the denominator
        sink = sink.view(1, h, 1, 1)
        mx = torch.maximum(s.amax(-1, keepdim=True), sink)
        e = torch.exp(s - mx)
        w = e / (torch.exp(sink - mx) + e.sum(-1, keepdim=True))
    else:
        w = torch.softmax(s, -1)
    w = torch.nan_to_num(w, nan=0.0)
    out = (w @ v).transpose(1, 2)  # (B, T, H, D)
    if name == "avnorm":
        flat = out.reshape(b * tq, h * d)
        if opts["kind"] == "layer":  # the AVnorm post: GroupNorm(num_groups=H, affine=False)
            y = F.group_norm(flat, h, eps=opts["eps"]).view(b, tq, h, d)
        elif opts["kind"] == "global":
            y = F.layer_norm(flat, (h * d,), eps=opts["eps"]).view(b, tq, h, d)
        else:
            y = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + opts["eps"])
        out = y * params["gain"].double().view(1, 1, h, 1)
    if spec.get("gate"):
        out = out * gate_values(spec["gate"], params, module.reference_gate_input, h)
    return out.to(query.dtype), None


def own_formula(norm: str):
    """The float64 `reference_weights` of a norm whose parity test brings it (tests/norms/test_<norm>.py), or None for
    the norms whose formulas this file writes out."""
    if norm in ("softmax", "psoftmax", "ssmax", "softmax1", "avnorm"):
        return None
    return importlib.import_module(f"tests.norms.test_{norm}").reference_weights


def gate_values(gate: dict, params: dict, x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H, 1 or D) float64: 2 * start * sigmoid(x[:, :, :I] @ W^T + b), the gate written from its formula."""
    w, b = params["gate.weight"].double(), params["gate.bias"].double()
    z = x[..., :w.shape[1]].double() @ w.T + b
    g = 2.0 * gate["start"] / (1.0 + torch.exp(-z))
    return g.view(*g.shape[:-1], heads, -1)


def _keep_input(module, args, kwargs):
    module.reference_gate_input = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def window_mask(tq: int, tk: int, window: int) -> torch.Tensor:
    """(Tq, Tk) bool: query i (cache index tk - tq + i) sees keys j with i - window < j <= i."""
    pos = torch.arange(tk - tq, tk)[:, None]
    keys = torch.arange(tk)[None, :]
    return (keys <= pos) & (keys > pos - window)


def naive_attention(q, k, v, norm, *, p=2.0, s_param=None, sink=None, scale=None, causal=True, attn_mask=None,
                    softcap=None, window=None):
    """float64 (B, H, Tq, Dv) attention for norm in psoftmax | ssmax | softmax1, from the full T x T weights.

    attn_mask: bool (True = attend) or additive (dtype min = hidden). window: sliding window applied on top.
    """
    rep = q.shape[1] // k.shape[1]
    k, v, q = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1), q.double()
    tq, tk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    allowed = allowed & window_mask(tq, tk, tk + tq) if causal else allowed
    allowed = allowed & window_mask(tq, tk, window) if window else allowed
    bias = torch.zeros((), dtype=torch.float64)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            allowed = allowed & (attn_mask > torch.finfo(attn_mask.dtype).min / 2)
            bias = attn_mask.double().masked_fill(~allowed, 0.0)
    allowed = allowed.expand(q.shape[0], q.shape[1], tq, tk)
    if norm == "ssmax":
        n = allowed.sum(-1, keepdim=True).clamp_min(1).double()
        q = q * (s_param.double().view(1, -1, 1, 1) * torch.log(n))
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = (s + bias).masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True)
    if norm == "softmax1":
        m = torch.maximum(m, sink.double().view(1, -1, 1, 1))
    m = m.masked_fill(~m.isfinite(), 0.0)
    e = torch.exp(s - m)
    if norm == "psoftmax":
        den = (e ** p).sum(-1, keepdim=True) ** (1.0 / p)
    elif norm == "softmax1":
        den = torch.exp(sink.double().view(1, -1, 1, 1) - m) + e.sum(-1, keepdim=True)
    else:
        den = e.sum(-1, keepdim=True)
    return (e / den.clamp_min(1e-300)) @ v


AttentionInterface.register(NAME, reference_attention)
AttentionMaskInterface.register(NAME, eager_mask)


def reference_model(original, patched, nope: bool):
    """The unpatched `original`'s twin, routed through the reference with `patched`'s norm parameters."""
    ref = copy.deepcopy(original)
    ref.config = copy.deepcopy(original.config)
    for m in ref.modules():
        if hasattr(m, "config"):
            m.config = ref.config
    record = patched.config.retrofit
    patched_attn = {n: m for n, m in patched.named_modules() if hasattr(m, "retrofit")}
    for name, module in ref.named_modules():
        if name in patched_attn:
            norm = patched_attn[name].retrofit
            params = {k: v.detach().clone() for k, v in list(norm.named_parameters()) + list(norm.named_buffers())}
            module.reference_spec = {"norm": record["norm"], "options": record["options"], "params": params,
                                     "gate": record.get("gate")}
            if record.get("gate"):
                module.register_forward_pre_hook(_keep_input, with_kwargs=True)
    assert sum(hasattr(m, "reference_spec") for m in ref.modules()) == len(patched_attn) > 0
    if nope:
        if ref.config.model_type == "gpt2":
            ref.transformer.wpe.weight.data.zero_()
        else:  # every frequency table (Gemma 3 has one per layer type) zeroed, and no cos/sin scaling
            rotary = ref.model.rotary_emb
            for buffer_name, buffer in rotary.named_buffers(recurse=False):
                if buffer_name.endswith("inv_freq"):
                    buffer.zero_()
            for attr in [a for a in vars(rotary) if a.endswith("attention_scaling")]:
                setattr(rotary, attr, 1.0)
    ref.set_attn_implementation(NAME)
    return ref
