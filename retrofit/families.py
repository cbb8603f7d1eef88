"""What retrofit knows about each model family, in one table keyed by `config.model_type`.

Adding a family whose attention goes through transformers' attention registry is one row here
(plus a tiny config in tests/tiny.py COVERAGE, so tests/patch/test_families.py runs it through the whole matrix).
Everything retrofit does differently per family is a field of its row, read where it matters: patching.py's refusals
(eager_bypass), the vLLM plugin's served and guarded architectures (vllm, read by serve/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


def _no_rope_layers(config) -> list[int]:
    """SmolLM3, Llama 4: layer i applies RoPE iff config.no_rope_layers[i] (1 = RoPE, 0 = none)."""
    return [i for i, use_rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not use_rope]


def _global_layers(config) -> list[int]:
    """Cohere 2 rotates q and k on its sliding layers only: its full-attention layers have no positions."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "full_attention"]


@dataclass(frozen=True)
class VllmModel:
    """vLLM's own model for a family (retrofit.serve): the plugin serves patched checkpoints on it, or guards it."""

    architecture: str  # config.json's architectures[0]: transformers' CausalLM class, vLLM's class of the same name
    module: str  # vLLM's module holding that class: vllm.model_executor.models.<module>
    # True: the plugin extends vLLM's model code for it (retrofit.serve.llama). False: a guard, vLLM's own model
    # refusing a patched checkpoint in one line instead of serving it as the original (retrofit.serve.guards).
    served: bool = False


@dataclass(frozen=True)
class Family:
    attention: str              # class name of the self-attention module that calls the registry
    positions: str              # "learned" (absolute table added to the embeddings) or "rotary"
    positions_path: str         # dotted path, from the CausalLM model, of the module that makes them
    max_learned_positions: str | None = None  # config key bounding learned positions (None: unbounded)
    final_norm: str = "model.norm"  # dotted path of the norm before the LM head
    nope_layers: Callable | None = None  # config -> indices of layers that add no positions already
    # A config flag that, set under eager, makes the attention module compute attention itself instead of calling
    # transformers' registry (so retrofit's function would never run): retrofit.patch refuses eager with it set.
    eager_bypass: str | None = None
    vllm: VllmModel | None = None  # vLLM's model for it (retrofit.serve); None: vLLM's, neither served nor guarded


# The attention module's output projection (its input is the heads' outputs, (B, T, H*D)), by attribute name:
# o_proj (Llama and most), c_proj (GPT-2), out_proj, dense, wo. AVNorm acts there (retrofit.patch).
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense", "wo")

FAMILIES: dict[str, Family] = {
    # GPT2Attention._upcast_and_reordered_attn: its own eager attention, never the registry's function
    "gpt2": Family("GPT2Attention", "learned", "transformer.wpe", "n_positions", "transformer.ln_f",
                   eager_bypass="reorder_and_upcast_attn", vllm=VllmModel("GPT2LMHeadModel", "gpt2")),
    "llama": Family("LlamaAttention", "rotary", "model.rotary_emb",
                    vllm=VllmModel("LlamaForCausalLM", "llama", served=True)),
    "mistral": Family("MistralAttention", "rotary", "model.rotary_emb",
                      vllm=VllmModel("MistralForCausalLM", "mistral")),
    "qwen2": Family("Qwen2Attention", "rotary", "model.rotary_emb", vllm=VllmModel("Qwen2ForCausalLM", "qwen2")),
    "gemma": Family("GemmaAttention", "rotary", "model.rotary_emb", vllm=VllmModel("GemmaForCausalLM", "gemma")),
    "gemma2": Family("Gemma2Attention", "rotary", "model.rotary_emb", vllm=VllmModel("Gemma2ForCausalLM", "gemma2")),
    "phi3": Family("Phi3Attention", "rotary", "model.rotary_emb", vllm=VllmModel("Phi3ForCausalLM", "phi3")),
    # Read from transformers 5.23's modeling files; each is in tests/patch/test_families.py's matrix.
    # q/k RMSNorm before RoPE: in the module
    "qwen3": Family("Qwen3Attention", "rotary", "model.rotary_emb", vllm=VllmModel("Qwen3ForCausalLM", "qwen3")),
    "qwen3_moe": Family("Qwen3MoeAttention", "rotary", "model.rotary_emb",
                        vllm=VllmModel("Qwen3MoeForCausalLM", "qwen3_moe")),
    "qwen2_moe": Family("Qwen2MoeAttention", "rotary", "model.rotary_emb",
                        vllm=VllmModel("Qwen2MoeForCausalLM", "qwen2_moe")),
    # MoE: attention is Mistral's
    "mixtral": Family("MixtralAttention", "rotary", "model.rotary_emb",
                      vllm=VllmModel("MixtralForCausalLM", "mixtral")),
    # sliding and full layers with one cos/sin table per layer type; scaling = query_pre_attn_scalar ** -0.5
    "gemma3_text": Family("Gemma3Attention", "rotary", "model.rotary_emb",
                          vllm=VllmModel("Gemma3ForCausalLM", "gemma3")),
    "smollm3": Family("SmolLM3Attention", "rotary", "model.rotary_emb", nope_layers=_no_rope_layers),
    "olmo2": Family("Olmo2Attention", "rotary", "model.rotary_emb"),
    "cohere2": Family("Cohere2Attention", "rotary", "model.rotary_emb", nope_layers=_global_layers),
    # scaling = config.attention_multiplier
    "granite": Family("GraniteAttention", "rotary", "model.rotary_emb",
                      vllm=VllmModel("GraniteForCausalLM", "granite")),
    "starcoder2": Family("Starcoder2Attention", "rotary", "model.rotary_emb"),
    # chunked-attention layers rotate (complex freqs_cis), NoPE layers scale q by a log-position temperature
    "llama4_text": Family("Llama4TextAttention", "rotary", "model.rotary_emb", nope_layers=_no_rope_layers),
    # learned per-head sinks (module.sinks, passed as s_aux) in its eager function; no sdpa path
    "gpt_oss": Family("GptOssAttention", "rotary", "model.rotary_emb", vllm=VllmModel("GptOssForCausalLM", "gpt_oss")),
}


# The MLP's output ("down") projection, by attribute name of the decoder layer's `mlp`: down_proj (Llama and most),
# c_proj (GPT-2), fc2 (Phi, OPT), w2, dense_4h_to_h. model.zero_init: mlp_output zeroes it (the AVnorm post's c_proj).
MLP_OUTPUT_PROJECTIONS = ("down_proj", "c_proj", "fc2", "w2", "dense_4h_to_h")


def output_projection(attention: nn.Module) -> nn.Module | None:
    """The attention module's output projection (an nn.Module named in OUTPUT_PROJECTIONS), or None."""
    return next((getattr(attention, n) for n in OUTPUT_PROJECTIONS if isinstance(getattr(attention, n, None),
                                                                                    nn.Module)), None)


def mlp_output_projections(model: nn.Module) -> list[nn.Module]:
    """The output projection of every decoder layer's dense MLP (a module named `mlp` with a MLP_OUTPUT_PROJECTIONS
    child that is an nn.Module holding a weight); an MoE block has none (its experts keep theirs)."""
    found = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "mlp":
            found += [getattr(module, n) for n in MLP_OUTPUT_PROJECTIONS
                      if isinstance(getattr(module, n, None), nn.Module) and hasattr(getattr(module, n), "weight")][:1]
    return found


def family_of(config) -> Family | None:
    return FAMILIES.get(getattr(config, "model_type", None))


def layers_without_positions(config) -> list[int]:
    """Layers of this model that already add no positional information (SmolLM3, Llama 4, Cohere 2)."""
    family = family_of(config)
    return family.nope_layers(config) if family is not None and family.nope_layers else []


# Models that already scale each query by a function of its position (a Llama-4-style attention temperature):
# SSMax on top would scale twice. (what it is, how its config says it is on). Read from transformers 5.23:
# Llama4TextAttention multiplies q by 1 + attn_scale*log1p(floor((pos+1)/floor_scale)) on its NoPE layers
# (no_rope_layers[i] == 0); Ministral3Attention (and Mistral 4) by 1 + beta*log(1 + floor(pos/original_max)).
POSITION_QUERY_SCALING = [
    ("Llama 4's attention temperature tuning (config.attn_temperature_tuning on its NoPE layers)",
     lambda c: bool(getattr(c, "attn_temperature_tuning", False))
     and not all(getattr(c, "no_rope_layers", None) or [1])),
    ("Llama-4-style query scaling (config.rope_parameters['llama_4_scaling_beta'])",
     lambda c: isinstance(getattr(c, "rope_parameters", None), dict)
     and c.rope_parameters.get("llama_4_scaling_beta") is not None),
]


def position_query_scaling(config) -> str | None:
    """What position-dependent query scaling this model already applies, or None."""
    return next((what for what, applies in POSITION_QUERY_SCALING if applies(config)), None)
