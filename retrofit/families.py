"""What retrofit knows about each model family, in one table keyed by `config.model_type`.

Adding a family whose attention goes through transformers' attention registry is one row here
(plus a tiny config in tests/tiny.py so the test matrix covers it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    attention: str              # class name of the self-attention module that calls the registry
    positions: str              # "learned" (absolute table added to the embeddings) or "rotary"
    positions_path: str         # dotted path, from the CausalLM model, of the module that makes them
    max_learned_positions: str | None = None  # config key bounding learned positions (None: unbounded)
    final_norm: str = "model.norm"  # dotted path of the norm before the LM head


FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT2Attention", "learned", "transformer.wpe", "n_positions", "transformer.ln_f"),
    "llama": Family("LlamaAttention", "rotary", "model.rotary_emb"),
    "mistral": Family("MistralAttention", "rotary", "model.rotary_emb"),
    "qwen2": Family("Qwen2Attention", "rotary", "model.rotary_emb"),
    "gemma": Family("GemmaAttention", "rotary", "model.rotary_emb"),
    "gemma2": Family("Gemma2Attention", "rotary", "model.rotary_emb"),
    "phi3": Family("Phi3Attention", "rotary", "model.rotary_emb"),
}


def family_of(config) -> Family | None:
    return FAMILIES.get(getattr(config, "model_type", None))


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
