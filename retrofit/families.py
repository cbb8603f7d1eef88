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
