"""vLLM's Llama running a retrofit patch: registered for `LlamaForCausalLM` by the plugin (retrofit.serve.register).

    LLM(model="runs/smollm2-ssmax", dtype="float32")      # with the plugin installed: nothing else to pass

A checkpoint without `config.retrofit` builds vLLM's own decoder layers, unchanged. With one, every decoder layer's
attention is RetrofitLlamaAttention, built through vLLM's seams (LlamaForCausalLM's `layer_type`, LlamaDecoderLayer's
`attn_layer_type`), and the patched ones hold retrofit's own norm module as their `retrofit` child, so the checkpoint's
`model.layers.i.self_attn.retrofit.*` weights load by name and the formulas are retrofit's code, not a copy. Each
norm says which step runs it (Norm.serve_as, one of plan.SERVE_STEPS); nothing here asks a norm's name:

    plain    vLLM's attention as it is                          (softmax: a RoPE extension or NoPE alone)
    queries  q (T, H, D) -> q * norm.logit_factor(n), n = position + 1   (SSMax; vLLM packs sequences: no padding,
             cached keys count)
    outputs  out (T, H, D) -> norm(out) before o_proj          (AVNorm; mode=beyond: out * norm.factor(n) per head)
    sinks    the norm's sink b_h handed to vLLM's Attention as its sinks (softmax+1: exp(b_h) in every denominator)
    nope     no rotary embedding on q and k
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from ..errors import RetrofitError
from ..norms import AttentionShape, get_norm, make_options
from ..norms.base import CHILD
from .plan import SINKS_REFUSED, ServePlan, serve_plan

# Attention backends whose kernel applies `sinks` though the backend class does not say so: vLLM's CPU backend hands
# them to its kernel as s_aux (v1/attention/backends/cpu_attn.py); tests/serve/test_serve_vllm.py checks softmax1
# parity.
SINK_BACKENDS = ("CPU_ATTN",)


class RetrofitLlamaAttention(LlamaAttention):
    """LlamaAttention plus the plan's norm on the layers it patches (the others run LlamaAttention.forward)."""

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int, *args, **kwargs):
        super().__init__(config, hidden_size, num_heads, num_kv_heads, *args, **kwargs)
        plan = serve_plan(config)
        self.nope = bool(plan and plan.nope)
        if plan is None or (plan.layers is not None and extract_layer_index(kwargs["prefix"]) not in plan.layers):
            return
        shape = AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim, plan.original_positions)
        norm = get_norm(plan.norm)(make_options(plan.norm, **plan.options), shape)
        norm.select_heads(list(plan.heads) if plan.heads is not None else None)
        self.add_module(CHILD, norm)
        if norm.serve_as == "sinks":
            self._rebuild_with_sinks(norm, kwargs.get("cache_config"), kwargs.get("quant_config"))

    def _rebuild_with_sinks(self, norm, cache_config, quant_config) -> None:
        """Build self.attn again with the norm's sink logits (the same tensor: a learned sink loads into it).
        LlamaAttention builds its Attention without sinks and the layer name is registered once: drop that
        registration first (vLLM raises on a duplicate name)."""
        old = self.attn
        get_current_vllm_config().compilation_config.static_forward_context.pop(old.layer_name)
        self.attn = Attention(old.num_heads, old.head_size, self.scaling, num_kv_heads=old.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              per_layer_sliding_window=old.sliding_window, attn_type=old.attn_type,
                              prefix=old.layer_name, sinks=norm.sink)  # (H,)
        backend = self.attn.attn_backend
        if not (backend.supports_sink() or backend.get_name() in SINK_BACKENDS):
            raise RetrofitError(SINKS_REFUSED.format(norm=norm.name, backend=backend.get_name()))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        norm = self._modules.get(CHILD)
        if norm is None and not self.nope:
            return super().forward(positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)  # (T, (H + 2 Hkv) D): vLLM packs every sequence's tokens in one row
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.nope:
            q, k = self.rotary_emb(positions, q, k)
        step = norm.serve_as if norm is not None else "plain"
        if step == "queries":
            q = self._scale_queries(norm, positions, q)
        out = self.attn(q, k, v)  # (T, H D)
        if step == "outputs":
            out = self._normalize_heads(norm, positions, out)
        output, _ = self.o_proj(out)
        return output

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)  # (T, H D) -> (T, H, D)

    def _scale_queries(self, norm, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q times the norm's logit factor per head and query (SSMax: f(n)), n = position + 1; unselected heads times
        exactly 1."""
        n = positions.float() + 1.0  # (T,) the keys each query may see
        factor = norm.logit_factor(n.view(1, 1, -1, 1))[0, ..., 0]  # (H, T) per head, or (1, T) (SSMax beyond, llama4)
        factor = factor.expand(self.num_heads, n.shape[0]).transpose(0, 1)  # (T, H)
        if norm.head_mask is not None:
            factor = torch.where(norm.head_mask.to(factor.device), factor, torch.ones_like(factor))
        return (self._heads(q).float() * factor.unsqueeze(-1)).to(q.dtype).view_as(q)

    def _normalize_heads(self, norm, positions: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """AVNorm of each head's output (retrofit's module, as its output-projection hook calls it); mode=beyond
        scales it by (max(n, L) / L)^b_h instead."""
        heads = self._heads(out)  # (T, H, D)
        if norm.on_output(norm.options):
            return norm.keep_unselected(norm(heads), heads).view_as(out)
        factor = norm.factor(positions.float() + 1.0)[0].transpose(0, 1)  # (1, H, T) -> (T, H)
        return norm.keep_unselected((heads.float() * factor.unsqueeze(-1)).to(out.dtype), heads).view_as(out)


class RetrofitLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix: str = "", config=None, attn_layer_type=RetrofitLlamaAttention):
        super().__init__(vllm_config, prefix, config, attn_layer_type)


class RetrofitLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM; a checkpoint with config.retrofit gets RetrofitLlamaDecoderLayer (refused in one
    line, before any module is built, when vLLM cannot run it exactly: retrofit.serve.plan)."""

    def __init__(self, *, vllm_config, prefix: str = "", layer_type=None):
        plan = checked_plan(vllm_config)
        if layer_type is None:
            layer_type = LlamaDecoderLayer if plan is None else RetrofitLlamaDecoderLayer
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


def checked_plan(vllm_config) -> ServePlan | None:
    """The plan of the model vLLM is building, refused where this engine cannot run it."""
    config = vllm_config.model_config.hf_config
    plan = serve_plan(config, where=str(vllm_config.model_config.model))
    if plan is not None and get_tensor_model_parallel_world_size() > 1:
        raise RetrofitError("retrofit's vLLM plugin serves a patched model with tensor_parallel_size=1 only (its "
                            "per-head parameters are not sharded yet)")
    return plan
