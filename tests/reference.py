"""Independent reference attention, written from the formulas in the seeds (not from retrofit's code).

Registered with transformers under its own name with eager's (additive) mask, it materializes the
full weight matrix in float64 and applies each norm exactly as the posts define it. A reference model
is the unpatched twin switched to this function, with positions removed by hand for NoPE: GPT-2's
table zeroed, rotary frequencies zeroed (cos = 1, sin = 0).
"""

from __future__ import annotations

import copy
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
    allowed = torch.ones(b, h, tq, k.shape[2], dtype=torch.bool)
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
    s = (q @ k.transpose(-1, -2)) * scaling + bias
    s = s.masked_fill(~allowed, -math.inf)
    if name == "psoftmax":
        e = torch.exp(s - s.amax(-1, keepdim=True))
        w = e / (e ** opts["p"]).sum(-1, keepdim=True) ** (1.0 / opts["p"])
    elif name == "softmax1":
        sink = params["sink"].double().view(1, h, 1, 1)
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
    return out.to(query.dtype), None


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
            module.reference_spec = {"norm": record["norm"], "options": record["options"], "params": params}
    assert sum(hasattr(m, "reference_spec") for m in ref.modules()) == len(patched_attn) > 0
    if nope:
        if ref.config.model_type == "gpt2":
            ref.transformer.wpe.weight.data.zero_()
        else:
            ref.model.rotary_emb.inv_freq.zero_()
            ref.model.rotary_emb.original_inv_freq = ref.model.rotary_emb.inv_freq
    ref.set_attn_implementation(NAME)
    return ref
